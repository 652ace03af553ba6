"""docs/configuration.md and the engine flags are checked against EngineConfig: every option is
documented with its default, and every flag the table names exists."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from engine_sidecar.engine_args import add_engine_arguments
from engine_sidecar.engine_config import EngineConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and (m := re.fullmatch(r"`(\w+)`", cells[0])):
            rows[m.group(1)] = (cells[1], cells[2])
    return rows


def test_every_engine_option_is_documented():
    rows = _rows()
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in rows]
    assert missing == []


def test_documented_flags_exist_and_numeric_defaults_match():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    rows = _rows()
    for field in dataclasses.fields(EngineConfig):
        flag, default = rows[field.name]
        if flag.startswith("`--"):
            assert flag.strip("`") in flags, (field.name, flag)
        value = field.default
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if field.name.endswith("_bytes"):
            documented = float(default.split()[0]) * (1 << 30 if "GiB" in default else 1)
            assert documented == value, (field.name, default)
        else:
            assert float(default.replace(",", "")) == value, (field.name, default)
