"""docs/configuration.md and the engine flags are checked against EngineConfig, walking its parts:
every setting is documented under its path (`store.ram_bytes`) with its flat keyword and default,
nothing documented is missing from the config, and every flag the tables name exists."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from engine_sidecar.engine_args import add_engine_arguments
from engine_sidecar.engine_config import EngineConfig, flat_options, parts

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _settings() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every setting's path -> (flat keyword, its dataclass field), the parts walked."""
    flat_of = {where: flat for flat, where in flat_options().items()}
    out = {}
    for top in dataclasses.fields(EngineConfig):
        part = parts().get(top.name)
        if part is None:
            out[top.name] = (flat_of[(None, top.name)], top)
            continue
        for sub in dataclasses.fields(part):
            out[f"{top.name}.{sub.name}"] = (flat_of[(top.name, sub.name)], sub)
    return out


def _rows() -> dict[str, tuple[str, str, str]]:
    """Documented settings: path -> (keyword, flag, default) from the five-column tables."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and (m := re.fullmatch(r"`([\w.]+)`", cells[0])):
            rows[m.group(1)] = (cells[1].strip("`"), cells[2], cells[3])
    return rows


def test_flat_keywords_are_unique_across_the_parts():
    names = [flat for flat, _ in _settings().values()]
    assert len(names) == len(set(names)) == len(flat_options())


def test_every_setting_is_documented_under_its_path_with_its_keyword():
    rows, settings = _rows(), _settings()
    assert sorted(set(settings) - set(rows)) == []  # undocumented
    assert sorted(set(rows) - set(settings)) == []  # documented but not in the config
    wrong = [(path, rows[path][0], flat) for path, (flat, _) in settings.items() if rows[path][0] != flat]
    assert wrong == []


def test_documented_flags_exist_and_numeric_defaults_match():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    rows = _rows()
    for path, (_, field) in _settings().items():
        _, flag, default = rows[path]
        if flag.startswith("`--"):
            assert flag.strip("`") in flags, (path, flag)
        value = field.default
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if field.name.endswith("_bytes"):
            documented = float(default.split()[0]) * (1 << 30 if "GiB" in default else 1)
            assert documented == value, (path, default)
        else:
            assert float(default.replace(",", "")) == value, (path, default)
