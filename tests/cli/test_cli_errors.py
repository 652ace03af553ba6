"""Bad model input through the real `ragcache` command: one line that says what to do, exit != 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_tiny_model


def run_cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAGCACHE_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "engine_sidecar.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ragcache: error:")
    for needle in needles:
        assert needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_missing_model_path(tmp_path):
    proc = run_cli("generate", "hi", "--model", str(tmp_path / "nope"), home=tmp_path)
    assert_one_line_error(proc, "does not exist")


def test_wrong_architecture(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    proc = run_cli("generate", "hi", "--model", str(model), home=tmp_path)
    assert_one_line_error(proc, "gpt2", "not supported")


def test_corrupt_safetensors(tmp_path, smol_dir):
    model = make_tiny_model(tmp_path / "m", "llama", tokenizer_from=smol_dir)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    proc = run_cli("generate", "hi", "--model", str(model), home=tmp_path)
    assert_one_line_error(proc, "damaged")


def test_unsupported_dtype_on_device(tmp_path, smol_dir):
    model = make_tiny_model(tmp_path / "m", "llama", tokenizer_from=smol_dir)
    proc = run_cli("generate", "hi", "--model", str(model), "--dtype", "float16", "--device", "cpu", home=tmp_path)
    assert_one_line_error(proc, "float16", "CPU")


def test_cuda_without_gpu(tmp_path, smol_dir):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    model = make_tiny_model(tmp_path / "m", "llama", tokenizer_from=smol_dir)
    proc = run_cli("generate", "hi", "--model", str(model), "--device", "cuda", home=tmp_path)
    assert_one_line_error(proc, "cuda")


def test_prepare_with_missing_gguf(tmp_path):
    proc = run_cli("model", "prepare", "--gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "o"),
                   home=tmp_path)
    assert_one_line_error(proc, "not found")


def test_prepare_with_non_gguf_file(tmp_path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    proc = run_cli("model", "prepare", "--gguf", str(bogus), "--out", str(tmp_path / "o"), home=tmp_path)
    assert_one_line_error(proc, "GGUF")


def test_non_utf8_chunk_file(tmp_path, smol_dir):
    model = make_tiny_model(tmp_path / "m", "llama", tokenizer_from=smol_dir)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    proc = run_cli("generate", "hi", "--model", str(model), "--chunk-file", str(bad), home=tmp_path)
    assert_one_line_error(proc, "UTF-8")


def test_every_subcommand_has_help(tmp_path):
    for args in (["--help"], ["model", "prepare", "--help"], ["generate", "--help"], ["demo", "--help"],
                 ["bench", "fidelity", "--help"], ["warm", "--help"], ["cache", "clear", "--help"]):
        proc = run_cli(*args, home=tmp_path)
        assert proc.returncode == 0, args
        assert "usage: ragcache" in proc.stdout


def test_prepare_is_idempotent(tmp_path, smol_dir):
    """The default model prepared by the fixture is recognised as up to date."""
    from engine_sidecar.model.prepare import default_gguf_path, is_prepared

    assert is_prepared(smol_dir, default_gguf_path())
    proc = run_cli("model", "prepare", "--out", str(smol_dir), home=tmp_path)
    assert proc.returncode == 0
    assert "already prepared" in proc.stderr
