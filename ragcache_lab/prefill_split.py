"""`python -m ragcache_lab.prefill_split`: what a long prefill does to a running stream, at several
`--prefill-token-budget`s side by side in one process.

For each budget, an engine (the default model on this machine) streams one answer of
`--stream-tokens` tokens; once it is decoding, `--arrivals` requests with long prompts (`--k`
passages each from a QA set, MuSiQue's by default; `--policy`, full prefill by default: the worst
case) are sent one after another. The
stream's gaps between tokens (the most, p99, median), the long requests' TTFT, and how often a
prefill paused for a decode step are reported. The default budget (8,192 tokens) never splits a
prompt of this length; smaller ones pause it between layers. Prints a table and writes JSON and
Markdown (`--json`).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from engine_sidecar import Engine
from ragcache_lab.gpu import describe_machine
from ragcache_lab.gpu_models import SHARED_DATA
from ragcache_lab.report import run_and_write
from ragcache_lab.stream import corpus_texts


def _gaps(engine: Engine, prompts: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    stream = engine.stream({"chunks": ["A short note."], "question": "Tell a long story."},
                           {"max_tokens": args.stream_tokens, "ignore_eos": True}, policy="full")
    ticks = stream.ticks()
    next(ticks)
    stamps: list[float] = []
    ttfts: list[float] = []
    pauses_before = engine.stats().prefill_pauses

    def send() -> None:
        for prompt in prompts:
            result = engine.generate(prompt, {"max_tokens": 4}, policy=args.policy)
            assert result.stats is not None
            ttfts.append(result.stats.ttft_s)

    sender = threading.Thread(target=send)
    stamps.append(time.perf_counter())
    sender.start()
    for _ in ticks:
        stamps.append(time.perf_counter())
        if not sender.is_alive():
            break
    sender.join()
    stream.close()
    gaps = sorted((b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False))
    p99 = gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))] if gaps else 0.0
    return {"tokens": len(gaps), "gap_max_ms": round(gaps[-1], 1) if gaps else 0.0, "gap_p99_ms": round(p99, 1),
            "gap_p50_ms": round(statistics.median(gaps), 1) if gaps else 0.0,
            "ttft_mean_s": round(statistics.mean(ttfts), 3), "prefill_pauses": engine.stats().prefill_pauses
            - pauses_before}


def run(args: argparse.Namespace) -> dict[str, Any]:
    texts, _ = corpus_texts(args.data or (SHARED_DATA if SHARED_DATA.is_file() else None))
    texts = [t for t in texts if len(t.split()) > 20]
    prompts = [{"chunks": [texts[(i * args.k + j) % len(texts)] for j in range(args.k)],
                "question": "Which of these passages is the oldest story?"} for i in range(args.arrivals)]
    rows = []
    for budget in args.budgets:
        with Engine.from_pretrained(args.model, device="cpu", dtype=args.dtype, disk=False,
                                    prefill_token_budget=budget) as engine:
            engine.generate(prompts[0], {"max_tokens": 2}, policy=args.policy)  # first-request costs off the clock
            rows.append({"budget": budget, **_gaps(engine, prompts, args)})
    return {"machine": describe_machine(torch.device("cpu")), "dtype": args.dtype, "policy": args.policy,
            "arrivals": len(prompts), "k": args.k, "rows": rows}


def table(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [f"A stream's gaps between tokens while {report['arrivals']} long prompts ({report['k']} passages, "
             f"{report['policy']}) arrive, {report['dtype']}; {machine.get('name')} "
             f"({', '.join(machine.get('cpu_flags', []))}), {machine.get('threads')} threads", "",
             "| --prefill-token-budget | stream tokens | gap max ms | gap p99 ms | gap p50 ms | long prompts' mean TTFT s "
             "| prefill pauses |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['budget']} | {r['tokens']} | {r['gap_max_ms']} | {r['gap_p99_ms']} | {r['gap_p50_ms']} | "
              f"{r['ttft_mean_s']} | {r['prefill_pauses']} |" for r in report["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragcache_lab.prefill_split", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a model folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--data", type=Path, default=None, help="QA set (default: ../shared/data/musique_s.json, "
                                                                "else the bundled sample)")
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 512, 128],
                        help="--prefill-token-budget values, comma-separated")
    parser.add_argument("--arrivals", type=int, default=3, help="long prompts sent while the stream decodes")
    parser.add_argument("--k", type=int, default=4, help="passages per long prompt (MuSiQue: ~2,400 tokens)")
    parser.add_argument("--policy", default="full", help="the long prompts' policy (default full: every row computed)")
    parser.add_argument("--stream-tokens", type=int, default=2000, help="the stream's answer, long enough to outlast "
                                                                        "the arrivals")
    parser.add_argument("--json", type=Path, default=Path("bench-results/prefill-split.json"))
    args = parser.parse_args(argv)
    return run_and_write(args, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
