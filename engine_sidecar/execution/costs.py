"""Adaptive recompute ratio: how much of a reused chunk to recompute, from what tokens cost here.

Recomputing a token costs t_compute (a prefill step); reusing it costs t_load (bringing its KV
from the tier it sits in). Recomputing a share r of the tokens hides behind loading the rest as
long as r·t_compute <= (1-r)·t_load, which gives the pipelined break-even
    r0 = t_load / (t_compute + t_load),
clipped to [r_min, r_max] so quality never drops below what r_min buys (CacheBlend's 15%). On a
fast tier (RAM) r0 is tiny and r_min decides; on a slow disk more recompute is free.

`golden_section_max` refines a ratio on a calibration set when a measured utility (e.g. quality
minus a TTFT penalty) is unimodal in r (`calibrate/ratio_search.py` measures both).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

R_MIN = 0.15
R_MAX = 1.0
_INV_PHI = (math.sqrt(5) - 1) / 2  # 1/golden ratio


def initial_ratio(t_compute: float, t_load: float, r_min: float = R_MIN, r_max: float = R_MAX) -> float:
    """r0 = t_load / (t_compute + t_load), clipped to [r_min, r_max]. Costs are per token."""
    if t_compute < 0 or t_load < 0 or t_compute + t_load == 0:
        raise ValueError("per-token costs must be non-negative and not both zero")
    if not 0.0 <= r_min <= r_max <= 1.0:
        raise ValueError("need 0 <= r_min <= r_max <= 1")
    return min(r_max, max(r_min, t_load / (t_compute + t_load)))


def golden_section_max(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-3,
                       max_evals: int = 64) -> tuple[float, int]:
    """Argmax of a unimodal f on [lo, hi] to within tol; returns (x, evaluations used).

    Each step keeps the larger of two interior points and shrinks the bracket by 1/phi, reusing
    one evaluation, so a calibration run costs one measurement per step."""
    if hi < lo:
        raise ValueError("need lo <= hi")
    a, b = lo, hi
    c, d = b - _INV_PHI * (b - a), a + _INV_PHI * (b - a)
    fc, fd = f(c), f(d)
    evals = 2
    while b - a > tol and evals < max_evals:
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - _INV_PHI * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _INV_PHI * (b - a)
            fd = f(d)
        evals += 1
    return (a + b) / 2, evals


@dataclass(frozen=True)
class TokenCosts:
    """Seconds per token, measured on this machine with this model."""

    compute: float
    load_ram: float
    load_disk: float

    def ratios(self, r_min: float = R_MIN, r_max: float = R_MAX) -> dict[str, float]:
        return {"ram": initial_ratio(self.compute, self.load_ram, r_min, r_max),
                "disk": initial_ratio(self.compute, self.load_disk, r_min, r_max)}


@dataclass
class CostMeter:
    """Per-token costs learned from the engine's own requests (exponential moving averages):
    compute from each prefill's token-layers, load per tier from copying cached KV into the
    request's buffer (RAM) and from reading it back from the disk tier. `ratio` turns them into
    r0 for policies asked for `:auto`."""

    weight: float = 0.2  # of the newest observation
    compute: float | None = None
    load: dict[str, float] = field(default_factory=dict)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new

    def observe_compute(self, seconds: float, tokens: float) -> None:
        if tokens > 0 and seconds > 0:
            self.compute = self._blend(self.compute, seconds / tokens)

    def observe_load(self, tier: str, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds >= 0:
            self.load[tier] = self._blend(self.load.get(tier), seconds / tokens)

    def ratio(self, tier: str, r_min: float = R_MIN, r_max: float = R_MAX) -> float:
        """r0 for KV coming from `tier`; r_min until both costs have been seen."""
        if self.compute is None or tier not in self.load:
            return r_min
        return initial_ratio(self.compute, self.load[tier], r_min, r_max)
