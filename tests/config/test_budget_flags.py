"""Byte-budget flags (`--ram-cache-gb`, `--max-body-mb`, ...) take finite sizes up to 1 PiB: 'inf'
or 1e300 is one usage line, never a traceback, and a positive size never becomes 0, which for
some budgets means unlimited."""

from __future__ import annotations

import argparse

import pytest

from engine_sidecar.engine_args import add_engine_arguments, engine_options, non_negative
from engine_sidecar.engine_config import MAX_BUDGET_BYTES, EngineConfig, flags
from engine_sidecar.server.serve_args import add_serve_arguments, settings_from_args
from tests.cli.test_cli_errors import run_cli

BUDGET_FLAGS = ["--ram-cache-gb", "--host-cache-gb", "--disk-cache-gb", "--batch-kv-gb", "--conversation-ram-gb",
                "--max-body-mb", "--passage-memory-mb"]


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    add_serve_arguments(parser)
    return parser


def test_every_flag_in_bytes_is_covered_here():
    from engine_sidecar.engine_config import dataclass_flags
    from engine_sidecar.server.settings import ServerSettings

    in_units = {s.flag.name for s in [*flags(), *dataclass_flags(ServerSettings)] if s.flag.unit != 1}
    assert in_units == set(BUDGET_FLAGS)


@pytest.mark.parametrize("flag", BUDGET_FLAGS)
@pytest.mark.parametrize("text,refusal", [("inf", "must be a finite number"), ("1e309", "must be a finite number"),
                                          ("1e300", "must be at most"), ("-inf", "must be")])
def test_an_infinite_or_absurd_budget_is_refused_by_the_parser(flag, text, refusal):
    with pytest.raises(argparse.ArgumentError, match=refusal):
        _serve_parser().parse_args([f"{flag}={text}"])  # "=": argparse takes a bare -inf for a flag


@pytest.mark.parametrize("flag", BUDGET_FLAGS)
def test_the_bound_itself_is_accepted_and_one_past_it_is_not(flag):
    unit = 1 << 30 if flag.endswith("-gb") else 1 << 20
    _serve_parser().parse_args([flag, str(MAX_BUDGET_BYTES // unit)])
    with pytest.raises(argparse.ArgumentError, match="at most"):
        _serve_parser().parse_args([flag, str(MAX_BUDGET_BYTES // unit + 1)])


def test_a_tiny_positive_budget_is_one_byte_never_zero():
    args = _serve_parser().parse_args(["--disk-cache-gb", "1e-300", "--ram-cache-gb", "5e-324",
                                       "--max-body-mb", "1e-300", "--batch-kv-gb", "0"])
    config = EngineConfig.from_options(**engine_options(args))
    assert config.store.disk_bytes == 1  # 0 would be an unlimited disk tier
    assert config.store.ram_bytes == 1
    assert config.batching.kv_bytes == 0  # zero stays zero
    assert settings_from_args(args, "ragcache").max_body_bytes == 1


def test_the_plain_parse_helper_refuses_infinity_too():
    assert non_negative("0") == 0 and non_negative("2.5") == 2.5
    for text in ("inf", "Infinity", "1e999"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite"):
            non_negative(text)


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--ram-cache-gb", "inf"], "--ram-cache-gb/--gpu-cache-gb: must be a finite number, got inf"),
    (["serve", "--disk-cache-gb", "1e300"], "--disk-cache-gb: must be at most 1048576 (1 PiB), got 1e300"),
    (["serve", "--max-body-mb", "inf"], "--max-body-mb: must be a finite number, got inf"),
    (["serve", "--conversation-ram-gb", "1e300"], "--conversation-ram-gb: must be at most"),
    (["warm", "--batch-kv-gb", "inf", "x.txt"], "--batch-kv-gb: must be a finite number"),
])
def test_the_command_refuses_in_one_line_with_exit_2(tmp_path, argv, needle):
    proc = run_cli(*argv, home=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
    assert not (tmp_path / "models").exists()  # refused before any model was prepared
