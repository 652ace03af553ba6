"""The engine flags every engine-running command shares, and the Engine they build.

The flags are generated from EngineConfig (engine_config.py holds each setting's flag, help and
default once). Kept below `cli/`, `calibrate/` and the benchmark lab (ragcache_lab/), which import
it; the CLI loads the benchmarks, so the benchmarks must not import the CLI. Standard library and the
plain-data config only: the engine (torch) is imported when `engine_from_args` runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_sidecar.engine_config import MAX_BUDGET_BYTES, FlagSetting, flags


def _finite(value: float, text: str) -> float:
    """`value` unless it is infinite (also what float() makes of a number past its range, 1e309):
    no setting takes infinity, and a byte budget of it cannot even be converted to bytes."""
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan and -inf
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return _finite(value, text)


def _int_within(text: str, low: int, high: int | None, refusal: str) -> int:
    """`text` as an int in [low, high]; otherwise argparse's one-line error saying `refusal`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{refusal}, got {text}")
    return value


def port_number(text: str) -> int:
    return _int_within(text, 0, 65535, "must be a TCP port from 0 to 65535 (0: a free one)")


def whole_number(text: str) -> int:
    return _int_within(text, 0, None, "must be >= 0")


def positive_int(text: str) -> int:
    return _int_within(text, 1, None, "must be at least 1")


def answer_tokens(text: str) -> int:
    """A request's `max_tokens` on the command line: the API's range."""
    return _int_within(text, 1, 4096, "must be from 1 to 4096")


def sampling_temperature(text: str) -> float:
    """A request's sampling `temperature` on the command line: the API's range, [0, 5]."""
    value = non_negative(text)
    if value > 5:
        raise argparse.ArgumentTypeError(f"must be from 0 to 5, got {text}")
    return value


def fused_temperature_arg(text: str) -> str | float:
    from engine_sidecar.execution.calibration import TemperatureSettingError, check_setting

    try:
        return check_setting(text)
    except TemperatureSettingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def above_zero(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan and -inf
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return _finite(value, text)


def _within_budget(parse: Callable[[str], float], unit: int) -> Callable[[str], float]:
    """`parse` for a byte budget given in `unit`s (GiB, MiB), also refusing what exceeds
    MAX_BUDGET_BYTES. Named as `parse` is, for argparse's message on text that is no number."""
    most = MAX_BUDGET_BYTES // unit

    def checked(text: str) -> float:
        value = parse(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most} (1 PiB), got {text}")
        return value

    checked.__name__ = parse.__name__
    return checked


def _in_setting_units(value: float, unit: int, default: object) -> object:
    """A flag's value in its setting's units. A positive budget too small for one whole unit
    (`--disk-cache-gb 1e-300`) becomes 1, never 0: 0 means unlimited for some budgets."""
    scaled = value * unit
    if isinstance(default, int):
        return max(1, int(scaled)) if scaled > 0 else 0
    return type(default)(scaled)


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a fraction from 0 to 1, got {text}")
    return value


_PARSERS: dict[str, Callable[[str], Any]] = {"path": Path, "non_negative": non_negative, "above_zero": above_zero,
                                              "whole": whole_number, "positive": positive_int,
                                              "temperature": fused_temperature_arg, "fraction": fraction}


def add_flags(p: argparse.ArgumentParser, settings: list[FlagSetting]) -> None:
    """Each setting's flag, with its help and its default (in the flag's unit) from the config."""
    for setting in settings:
        flag = setting.flag
        if flag.negates:
            p.add_argument(flag.name, *flag.aliases, action="store_true", help=flag.help)
            continue
        default = setting.field.default
        if flag.unit != 1:
            default = default / flag.unit
        shown = "" if default is None else f" (default: {default:g})" if isinstance(default, float) \
            else f" (default: {default})"
        options: dict[str, Any] = {"default": default, "help": flag.help + shown}
        if flag.parse in _PARSERS:
            parse = _PARSERS[flag.parse]
            options["type"] = _within_budget(parse, flag.unit) if flag.unit != 1 else parse
        if setting.choices:
            options["choices"] = list(setting.choices)
        p.add_argument(flag.name, *flag.aliases, **options)


def options_from(args: argparse.Namespace, settings: list[FlagSetting]) -> dict[str, Any]:
    """The settings' values from parsed flags, by each setting's keyword."""
    options: dict[str, Any] = {}
    for setting in settings:
        flag = setting.flag
        value = getattr(args, flag.name.removeprefix("--").replace("-", "_"))
        if flag.negates:
            value = not value
        elif flag.unit != 1:
            value = _in_setting_units(value, flag.unit, setting.field.default)
        options[setting.flat] = value
    return options


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags, generated from EngineConfig: each setting's flag, help and default are
    written once, in engine_config.py."""
    add_flags(p, flags())


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's settings from parsed engine flags, by flat keyword."""
    return options_from(args, flags())


def engine_from_args(args: argparse.Namespace):
    from engine_sidecar.engine.engine import Engine

    options = engine_options(args)
    return Engine.from_pretrained(options.pop("model"), **options)
