"""The measurements behind `ragcache calibrate-ratio`: per-token compute and load costs taken on
this machine, and a recompute ratio refined on a calibration set (quality against a TTFT penalty)
by golden-section search over the costs' break-even ratio.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_sidecar.execution.costs import TokenCosts, golden_section_max


def measure_costs(engine, text: str, work_dir: Path, repeats: int = 3) -> TokenCosts:
    """Per-token prefill cost (a fresh chunk computed in full) and per-token load cost from RAM
    (copying the stored KV) and from the disk tier (reading it back), best of `repeats`."""
    import torch

    from engine_sidecar.store.disk import DiskTier
    from ragcache_integrations.types import Chunk

    seg = engine.builder.chunk_segment(Chunk(text=text))
    prefix = engine.builder.prefix_segment("")
    n = len(seg.token_ids)
    compute = ram = disk = math.inf
    tier = DiskTier(work_dir)
    for i in range(repeats):
        start = time.perf_counter()
        entry = engine.precompute.compute_chunk_kv(seg, prefix, tenant="calibrate")
        compute = min(compute, (time.perf_counter() - start) / n)
        start = time.perf_counter()
        torch.cat([entry.keys.clone(), entry.values.clone()])
        ram = min(ram, (time.perf_counter() - start) / n)
        digest = f"calibrate-{i}"
        tier.put(digest, entry)
        tier.flush()
        start = time.perf_counter()
        loaded = tier.get(digest)
        disk = min(disk, (time.perf_counter() - start) / n)
        assert loaded is not None, "the disk tier lost an entry it just wrote"
    return TokenCosts(compute, ram, disk)


@dataclass
class Refinement:
    """`ragcache calibrate --data`: the ratio that maximized quality - penalty * TTFT share."""

    ratio: float
    evaluations: list[dict[str, float]]
    penalty: float


def refine_ratio(engine, prompts: list, lo: float, hi: float, penalty: float = 0.5, max_tokens: int = 16,
                 tol: float = 0.05, max_evals: int = 8, on_eval: Callable[[dict[str, float]], None] | None = None
                 ) -> Refinement:
    """Golden-section search over the CacheBlend ratio r in [lo, hi] on calibration prompts.

    Utility(r) = mean ROUGE-L of the answer vs full prefill's - penalty * mean(TTFT / full TTFT),
    measured side by side (full prefill of every prompt is timed once up front, the chunks are
    warmed, and each r answers every prompt). Quality rises with r and so does TTFT, so the
    utility is close to unimodal; noise in TTFT can still move the answer by about `tol`."""
    from engine_sidecar.bench.metrics import rouge_l

    sampling = {"max_tokens": max_tokens}
    full = [engine.generate(p, sampling, policy="full") for p in prompts]
    for p in prompts:
        engine.warm(p.chunks, system=p.system)
    evaluations: list[dict[str, float]] = []

    def utility(r: float) -> float:
        quality, share = [], []
        for p, reference in zip(prompts, full, strict=True):
            result = engine.generate(p, sampling, policy=f"cacheblend:{r}")
            quality.append(rouge_l(result.text, reference.text))
            share.append(result.stats.ttft_s / max(reference.stats.ttft_s, 1e-9))
        row = {"ratio": r, "rouge_l_vs_full": sum(quality) / len(quality), "ttft_vs_full": sum(share) / len(share)}
        row["utility"] = row["rouge_l_vs_full"] - penalty * row["ttft_vs_full"]
        evaluations.append(row)
        if on_eval is not None:
            on_eval(row)
        return row["utility"]

    best, _ = golden_section_max(utility, lo, hi, tol=tol, max_evals=max_evals)
    return Refinement(best, evaluations, penalty)
