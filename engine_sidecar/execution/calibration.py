"""Attention temperatures (`tempT`) fitted for a model, which the engine applies to a
policy that names none.

A fit belongs to a model's weights (whatever dtype they run in) and to the policy family it was
fitted with: T fitted for cacheblend says nothing about prophet or reuse, so those stay at 1.
`ragcache calibrate-temperature --save` keeps the user's own fits under
$RAGCACHE_HOME/calibration/<weights fingerprint>.json; the fits the project made for the default
model ship in `known_temperatures.json` beside this module. The user's fit wins.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine_sidecar.paths import ragcache_home
from ragcache_integrations.policy_registry import BY_NAME

AUTO = "auto"  # the model's fitted T per policy family, 1 where none was fitted
OFF = "off"  # 1 for every policy unless the policy names its own tempT
KNOWN_FITS = Path(__file__).with_name("known_temperatures.json")


class TemperatureSettingError(ValueError):
    """A `fused_temperature` setting that is neither auto, off nor a number > 0."""


def check_setting(value: str | float) -> str | float:
    """`auto`, `off` or a temperature > 0 (numbers given as text become floats)."""
    if isinstance(value, str) and value.strip().lower() in (AUTO, OFF):
        return value.strip().lower()
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise TemperatureSettingError(
            f"fused_temperature must be 'auto' (the model's calibrated T), 'off' or a number > 0, got {value!r}")
    return number


def tempering_policies() -> list[str]:
    """The policy families a temperature acts on (those that reuse chunk KV)."""
    return [entry.name for entry in BY_NAME.values() if entry.tempers]


def saved_fits_path(weights_fp: str) -> Path:
    return ragcache_home() / "calibration" / f"{weights_fp}.json"


def _fits_of(path: Path, weights_fp: str | None) -> dict[str, float]:
    """policy name -> T from a fits file; a missing, unreadable or foreign file gives none (a
    calibration only ever improves answers, so losing one must not stop the engine)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    if weights_fp is not None:  # the shipped file holds several models
        data = data.get(weights_fp, {}) if isinstance(data, dict) else {}
    fits = data.get("temperatures", {}) if isinstance(data, dict) else {}
    out: dict[str, float] = {}
    for name, entry in fits.items() if isinstance(fits, dict) else ():
        value = entry.get("temperature") if isinstance(entry, dict) else entry
        if name in BY_NAME and BY_NAME[name].tempers and isinstance(value, int | float) and math.isfinite(value) and value > 0:
            out[name] = float(value)
    return out


def known_fits(weights_fp: str) -> dict[str, float]:
    return _fits_of(KNOWN_FITS, weights_fp)


def saved_fits(weights_fp: str) -> dict[str, float]:
    return _fits_of(saved_fits_path(weights_fp), None)


def fitted_temperatures(weights_fp: str) -> dict[str, float]:
    """The model's fits: the project's, overridden by the user's."""
    return {**known_fits(weights_fp), **saved_fits(weights_fp)}


def resolve(setting: str | float, weights_fp: str) -> dict[str, float]:
    """policy name -> the T the engine applies when a request's policy names none."""
    setting = check_setting(setting)
    if setting == AUTO:
        return fitted_temperatures(weights_fp)
    if setting == OFF:
        return {}
    return {name: float(setting) for name in tempering_policies()}


def save_fit(weights_fp: str, policy_name: str, temperature: float, provenance: dict[str, Any]) -> Path:
    """Record T for `policy_name` on this model (other policies' fits kept); atomic, so a
    reader never sees half a file."""
    if policy_name not in BY_NAME or not BY_NAME[policy_name].tempers:
        raise TemperatureSettingError(f"policy '{policy_name}' reuses no chunk KV: no temperature to keep")
    path = saved_fits_path(weights_fp)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("temperatures"), dict):
            data = {}
    except (OSError, json.JSONDecodeError):
        data = {}
    data.setdefault("temperatures", {})[policy_name] = {
        "temperature": float(temperature), "saved": datetime.now(UTC).isoformat(timespec="seconds"), **provenance}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path
