"""The engine flags are generated from EngineConfig: each flag belongs to one setting, its default
is the setting's, and a value given on the command line reaches that setting and no other."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from engine_sidecar.engine_args import add_engine_arguments, engine_options
from engine_sidecar.engine_config import EngineConfig, flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    return parser


def _settings(config: EngineConfig) -> dict[str, object]:
    out = {}
    for top in dataclasses.fields(config):
        value = getattr(config, top.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{top.name}.{k}": v for k, v in dataclasses.asdict(value).items()})
        else:
            out[top.name] = value
    return out


def test_the_parser_has_exactly_the_configs_flags():
    options = {opt for action in _parser()._actions for opt in action.option_strings} - {"-h", "--help"}
    assert options == {name for s in flags() for name in (s.flag.name, *s.flag.aliases)}
    assert sum(1 + len(s.flag.aliases) for s in flags()) == len(options)  # no two settings share a flag


def test_no_flags_give_the_configs_defaults():
    assert EngineConfig.from_options(**engine_options(_parser().parse_args([]))) == EngineConfig()


def _a_value(setting) -> tuple[list[str], object]:
    """Command-line words that set `setting` to something other than its default, and that value."""
    flag, default = setting.flag, setting.field.default
    if flag.negates:
        return [flag.name], not default
    if flag.unit != 1:
        return [flag.name, "0.25"], flag.unit // 4
    if setting.choices:
        other = next(c for c in setting.choices if c != default)
        return [flag.name, other], other
    return {
        "positive": ([flag.name, "3"], 3),
        "whole": ([flag.name, "0"], 0) if default != 0 else ([flag.name, "5"], 5),
        "non_negative": ([flag.name, "7.5"], 7.5),
        "above_zero": ([flag.name, "7.5"], 7.5),
        "temperature": ([flag.name, "off"], "off"),
        "fraction": ([flag.name, "0.25"], 0.25),
        "path": ([flag.name, "/tmp/kv-elsewhere"], Path("/tmp/kv-elsewhere")),
        "text": ([flag.name, "given-on-the-command-line"], "given-on-the-command-line"),
    }[flag.parse]


@pytest.mark.parametrize("setting", flags(), ids=lambda s: s.flag.name)
def test_a_flag_reaches_its_setting_and_no_other(setting):
    words, value = _a_value(setting)
    config = EngineConfig.from_options(**engine_options(_parser().parse_args(words)))
    changed = {k: v for k, v in _settings(config).items() if _settings(EngineConfig())[k] != v}
    assert list(changed.values()) == [value], (words, changed)


def test_help_comes_from_the_config_with_the_default():
    help_text = {a.option_strings[0]: a.help for a in _parser()._actions}
    for setting in flags():
        assert help_text[setting.flag.name].startswith(setting.flag.help)
    assert help_text["--ram-cache-gb"].endswith("(default: 2)")
    assert help_text["--max-batch"].endswith("(default: 16)")


def test_a_bad_value_is_refused_by_the_parser():
    with pytest.raises(argparse.ArgumentError, match="at least 1"):
        _parser().parse_args(["--max-batch", "0"])
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        _parser().parse_args(["--precompute", "sometimes"])


def test_serve_flags_come_from_the_server_settings(monkeypatch):
    """`ragcache serve`'s operator flags are generated from ServerSettings the same way: no flags
    give its defaults, and each flag reaches its own field."""
    from engine_sidecar.engine_config import dataclass_flags
    from engine_sidecar.server.serve_args import add_serve_arguments, settings_from_args
    from engine_sidecar.server.settings import ServerSettings

    monkeypatch.delenv("RAGCACHE_API_KEY", raising=False)  # the key's fallback when no flag gives one
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    options = {opt for action in parser._actions for opt in action.option_strings}
    generated = dataclass_flags(ServerSettings)
    assert {s.flag.name for s in generated} <= options and len(generated) == 9
    assert settings_from_args(parser.parse_args([]), "ragcache") == ServerSettings()
    for setting in generated:
        words, value = _a_value(setting)
        got = dataclasses.asdict(settings_from_args(parser.parse_args(words), "ragcache"))
        changed = {k: v for k, v in got.items() if dataclasses.asdict(ServerSettings())[k] != v}
        assert list(changed.values()) == [value], (words, changed)
    with pytest.raises(argparse.ArgumentError, match="above 0"):
        parser.parse_args(["--request-timeout", "-1"])
