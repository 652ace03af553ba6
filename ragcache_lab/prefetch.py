"""`ragcache bench prefetch`: TTFT with a cold disk tier, layer-wise prefetch vs synchronous load.

Every request starts cold: the RAM tier is emptied and the cache files are evicted from the page
cache (fsync, then posix_fadvise DONTNEED, which the kernel may honour only in part; the measured
per-token read cost shows what it did). The two modes answer the same prompts with the same
engine, interleaved and alternating which goes first, so the ratio is measured side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import track

from ragcache_integrations.types import ChunkedPrompt
from ragcache_lab.report import write_report
from ragcache_lab.tables import markdown_table

MODES = ("sync", "prefetch")


def evict_page_cache(directory: Path) -> int:
    """Ask the kernel to drop the cached pages of every file under `directory`; returns how many."""
    os.sync()
    count = 0
    for path in directory.rglob("*.kv.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


def run_prefetch(args: argparse.Namespace) -> int:
    import tempfile

    from engine_sidecar.calibrate.datasets import chunk_texts, load_dataset
    from engine_sidecar.engine_args import engine_from_args

    if args.n < 1 or args.k < 1 or args.repeats < 1:
        raise SystemExit("ragcache bench prefetch: --n, --k and --repeats must be at least 1")
    if args.no_disk:
        raise SystemExit("ragcache bench prefetch: needs the disk tier (drop --no-disk)")
    console = Console()
    records = load_dataset(args.data)[: args.n]
    prompts = [ChunkedPrompt(chunks=chunk_texts(r, args.k), question=r["question"]) for r in records]
    args.no_prefix_tree = True  # exact prefix hits would hide the tier under test
    own_dir = None
    if args.cache_dir is None:
        own_dir = tempfile.TemporaryDirectory(prefix="ragcache-prefetch-")
        args.cache_dir = Path(own_dir.name)
    rows: list[dict[str, Any]] = []
    try:
        with engine_from_args(args) as engine:
            for p in prompts:
                engine.warm(p.chunks, system=p.system)
            engine.generate(prompts[0], {"max_tokens": 1}, policy=args.policy)  # stores the template prefix
            store = engine.chunk_store()
            store.flush()
            cache_dir = engine.health().disk_dir
            for i, prompt in enumerate(track(prompts, description="cold requests", console=console)):
                for rep in range(args.repeats):
                    order = MODES if (i + rep) % 2 == 0 else MODES[::-1]
                    for mode in order:
                        engine.settings().store.prefetch = mode == "prefetch"
                        store.ram.clear()
                        evict_page_cache(cache_dir)
                        result = engine.generate(prompt, {"max_tokens": 1}, policy=args.policy)
                        s = result.stats
                        rows.append({"question": i, "repeat": rep, "mode": mode, "ttft_s": s.ttft_s,
                                     "chunk_hits": s.chunk_hits, "prompt_tokens": s.prefill_tokens_total,
                                     "stage_times": s.stage_times})
    finally:
        if own_dir is not None:
            own_dir.cleanup()
    summary = prefetch_summary(rows)
    config = {"data": str(args.data), "n": len(prompts), "k": args.k, "repeats": args.repeats, "policy": args.policy,
              "model": str(args.model)}
    table = prefetch_table(summary, config)
    print(table)
    if args.json:
        written = write_report(args.json, {"config": config, "summary": summary, "rows": rows}, table)
        console.print("wrote " + ", ".join(str(p) for p in written))
    return 0


def prefetch_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        out[mode] = {
            "ttft_median_s": statistics.median(r["ttft_s"] for r in mine),
            "prefill_median_s": statistics.median(r["stage_times"].get("prefill_s", 0.0) for r in mine),
            "plan_median_s": statistics.median(r["stage_times"].get("plan_s", 0.0) for r in mine),
            "read_median_s": statistics.median(r["stage_times"].get("prefetch_read_s", 0.0) for r in mine),
            "wait_median_s": statistics.median(r["stage_times"].get("prefetch_wait_s", 0.0) for r in mine),
            "chunk_hits_mean": statistics.mean(r["chunk_hits"] for r in mine),
        }
    # per (question, repeat) pair: the two modes measured back to back
    pairs = {}
    for r in rows:
        pairs.setdefault((r["question"], r["repeat"]), {})[r["mode"]] = r["ttft_s"]
    ratios = [p["prefetch"] / p["sync"] for p in pairs.values() if len(p) == 2 and p["sync"] > 0]
    out["ttft_ratio_prefetch_vs_sync_median"] = statistics.median(ratios)
    return out


def prefetch_table(summary: dict[str, Any], config: dict[str, Any]) -> str:
    title = (f"cold disk tier: {config['n']} questions x {config['repeats']} repeats, k={config['k']}, "
             f"policy {config['policy']}, model {config['model']}")
    header = ["mode", "TTFT median (s)", "plan (s)", "prefill (s)", "layer reads (s)", "waited for reads (s)"]
    cells = [[mode, *(f"{summary[mode][key]:.3f}" for key in ("ttft_median_s", "plan_median_s", "prefill_median_s",
                                                              "read_median_s", "wait_median_s"))] for mode in MODES]
    return "\n".join([title, "", markdown_table(header, cells), "",
                      f"TTFT prefetch / sync (median of back-to-back pairs): "
                      f"{summary['ttft_ratio_prefetch_vs_sync_median']:.3f}"])
