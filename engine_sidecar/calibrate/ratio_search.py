"""`ragcache calibrate`: per-token compute and load costs taken on this machine, the recompute
ratio they imply per cache tier, and with `--data` that ratio refined on a calibration set (quality
against a TTFT penalty) by golden-section search over the costs' break-even ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_sidecar.calibrate.metrics import rouge_l
from engine_sidecar.execution.costs import R_MAX, TokenCosts, golden_section_max


def measure_costs(engine, text: str, work_dir: Path, repeats: int = 3) -> TokenCosts:
    """Per-token prefill cost (a fresh chunk computed in full) and per-token load cost from RAM
    (copying the stored KV) and from the disk tier (reading it back), best of `repeats`."""
    import torch

    from engine_sidecar.store.disk import DiskTier

    compute = ram = disk = math.inf
    tier = DiskTier(work_dir)
    for i in range(repeats):
        start = time.perf_counter()
        entry = engine.chunk_kv(text, tenant="calibrate")
        n = entry.num_tokens
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


def run_calibrate(args: argparse.Namespace) -> int:
    from engine_sidecar.engine_args import engine_from_args

    if not 0.0 <= args.r_min <= R_MAX:
        raise SystemExit("ragcache calibrate: --r-min must be between 0 and 1")
    if args.repeats < 1 or args.n < 1 or args.k < 1 or args.max_evals < 2:
        raise SystemExit("ragcache calibrate: --repeats, --n and --k must be at least 1, --max-evals at least 2")
    records = None
    if args.data is not None:
        from engine_sidecar.calibrate.datasets import load_dataset

        records = load_dataset(args.data)[: args.n]
        args.no_prefix_tree = True  # repeated prompts must not turn into exact prefix hits
    text = (args.text_file.read_text(encoding="utf-8") if args.text_file else
            "Retrieved passages are reused across questions; their keys and values are cached. " * 24)
    with engine_from_args(args) as engine, tempfile.TemporaryDirectory(prefix="ragcache-calibrate-") as work:
        costs = measure_costs(engine, text, Path(work), repeats=args.repeats)
        ratios = costs.ratios(r_min=args.r_min)
        print(f"per token: compute {costs.compute * 1e3:.3f} ms, load from RAM {costs.load_ram * 1e6:.2f} us, "
              f"load from disk {costs.load_disk * 1e6:.2f} us")
        print(f"r0 = t_load / (t_compute + t_load), clipped to [{args.r_min}, {R_MAX}]: "
              f"RAM tier {ratios['ram']:.3f}, disk tier {ratios['disk']:.3f} (use cacheblend:<r0>, or "
              "cacheblend:auto to let the engine apply it from its running measurements)")
        result: dict[str, Any] = {"seconds_per_token": {"compute": costs.compute, "load_ram": costs.load_ram,
                                                        "load_disk": costs.load_disk}, "r0": ratios,
                                  "r_min": args.r_min}
        if records is not None:
            result["refined"] = _refine_on(engine, records, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _refine_on(engine: Any, records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """`--data`: the golden-section search on the calibration questions, printed as it goes."""
    from engine_sidecar.calibrate.datasets import chunk_texts
    from ragcache_integrations.types import ChunkedPrompt

    prompts = [ChunkedPrompt(chunks=chunk_texts(r, args.k), question=r["question"]) for r in records]
    print(f"golden-section search over r in [{args.r_min}, 1] on {len(prompts)} questions "
          f"(utility = ROUGE-L vs full - {args.penalty} x TTFT/full):")
    refined = refine_ratio(engine, prompts, args.r_min, 1.0, penalty=args.penalty, max_tokens=args.max_tokens,
                           max_evals=args.max_evals,
                           on_eval=lambda row: print(f"  r {row['ratio']:.3f}: ROUGE-L {row['rouge_l_vs_full']:.3f}, "
                                                     f"TTFT/full {row['ttft_vs_full']:.3f}, "
                                                     f"utility {row['utility']:.3f}", flush=True))
    print(f"refined ratio: {refined.ratio:.3f} (use cacheblend:{refined.ratio:.2f})")
    return {"ratio": refined.ratio, "penalty": refined.penalty, "evaluations": refined.evaluations,
            "data": str(args.data), "n": len(prompts)}
