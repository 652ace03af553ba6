"""The main job on embedded defaults: related questions over the same retrieved passages, each
answered through the engine, with what reuse saved measured against full prefill of the same
prompt in the same run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ragcache_integrations.types import ChunkedPrompt, SamplingParams

BUNDLED = Path(__file__).resolve().parents[2] / "examples" / "data" / "demo.json"


def run_demo(args: argparse.Namespace) -> int:
    from engine_sidecar.engine_args import engine_from_args

    console = Console()
    data = json.loads((args.data or BUNDLED).read_text(encoding="utf-8"))
    passages, questions = data["passages"], data["questions"]
    console.print(f"[bold]ragcache demo[/bold]: {len(questions)} questions over the same {len(passages)} passages")
    table = Table(title="what reuse saved (TTFT, same prompt, same run)")
    for col in ("turn", "chunk hits", "reused", "recomputed", "fresh", "TTFT", "full prefill", "speed-up"):
        table.add_column(col, justify="right")
    with engine_from_args(args) as engine:
        health = engine.health()
        console.print(f"model {health.model}, {health.device}, {health.dtype}")
        engine.clear_cache()
        for turn, question in enumerate(questions, 1):
            order = passages if turn % 2 else list(reversed(passages))  # retrievers reorder; fusion still hits
            prompt = ChunkedPrompt(question=question, chunks=order)
            sampling = SamplingParams(max_tokens=args.max_tokens)
            baseline = engine.measure_full_prefill(prompt)
            result = engine.generate(prompt, sampling, policy=args.policy)
            s = result.stats
            console.print(f"\n[bold]Q{turn}[/bold] {question}\n[green]A{turn}[/green] {result.text.strip()}")
            table.add_row(str(turn), f"{s.chunk_hits}/{s.chunk_hits + s.chunk_misses}", str(s.tokens_reused),
                          str(s.tokens_recomputed), str(s.tokens_computed_fresh), f"{s.ttft_s:.2f}s",
                          f"{baseline:.2f}s", f"{baseline / s.ttft_s:.1f}x")
    console.print()
    console.print(table)
    console.print("Turn 1 pays for precomputing the passages' KV (misses); later turns fuse the cached KV "
                  f"with policy {args.policy}, recomputing a few tokens.")
    return 0
