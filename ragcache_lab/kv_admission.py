"""`python -m ragcache_lab.kv_admission`: how many requests run at once in the same KV budget with
buffers of their own (admitted by prompt + max_tokens) and with the block pool (admitted by the
blocks in use, preempting when they outgrow it), side by side in one process.

`--requests` concurrent requests, each `--k` passages of a QA set (MuSiQue's by default, warmed
first so the prefills are mostly reads) and its own question, ask for up to `--max-tokens`
tokens, as chat clients often do, and stop where the model ends its answer. Both engines get
`--kv-gib` for the running requests' KV. Reported per variant: the most requests decoded in one
step, preemptions, wall time, output tokens/s, TTFT p50, and whether the answers equal the
buffers' (greedy). Prints a table and writes JSON and Markdown (`--json`).
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
from engine_sidecar.calibrate.datasets import chunk_texts, load_dataset
from ragcache_lab.gpu import describe_machine
from ragcache_lab.gpu_models import SHARED_DATA
from ragcache_lab.report import run_and_write

GIB = 1 << 30


def _variant(args: argparse.Namespace, prompts: list[dict], block_size: int) -> dict[str, Any]:
    options = {"kv_block_size": block_size} if block_size else {}
    with Engine.from_pretrained(args.model, device="cpu", dtype=args.dtype, disk=False,
                                batch_kv_bytes=int(args.kv_gib * GIB), **options) as engine:
        engine.warm([c for p in prompts for c in p["chunks"]])
        sampling = {"max_tokens": args.max_tokens, "temperature": 0}
        results: list[Any] = [None] * len(prompts)

        def ask(i: int) -> None:
            results[i] = engine.generate(prompts[i], sampling)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        stats = engine.stats()
        produced = sum(len(r.token_ids) for r in results)
        return {"block_size": block_size, "peak_batch": stats.peak_batch,
                "preemptions": stats.preemptions, "wall_s": round(wall, 2),
                "output_tokens": produced, "tokens_per_s": round(produced / wall, 2),
                "ttft_p50_s": round(statistics.median(r.stats.ttft_s for r in results), 3),
                "answers": [r.token_ids for r in results]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    records = load_dataset(args.data or SHARED_DATA)[: args.requests]
    prompts = [{"chunks": chunk_texts(r, args.k), "question": r["question"]} for r in records]
    rows = [_variant(args, prompts, 0), _variant(args, prompts, args.block_size)]
    buffers = rows[0]["answers"]
    for row in rows:
        row["answers_equal_buffers"] = row.pop("answers") == buffers
    return {"machine": describe_machine(torch.device("cpu")), "dtype": args.dtype, "kv_gib": args.kv_gib,
            "requests": len(prompts), "k": args.k, "max_tokens": args.max_tokens, "rows": rows}


def table(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [f"{report['requests']} concurrent requests ({report['k']} passages each, max_tokens "
             f"{report['max_tokens']}, answers end where the model stops) in {report['kv_gib']} GiB of running KV, "
             f"{report['dtype']}; {machine.get('name')} ({', '.join(machine.get('cpu_flags', []))}), "
             f"{machine.get('threads')} threads", "",
             "| KV held as | most decoded at once | preemptions | wall s | output tok/s | TTFT p50 s |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        held = f"block pool, {r['block_size']}-row blocks" if r["block_size"] else "a buffer per request"
        lines.append(f"| {held} | {r['peak_batch']} | {r['preemptions']} | {r['wall_s']} | {r['tokens_per_s']} | "
                     f"{r['ttft_p50_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragcache_lab.kv_admission", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a model folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--data", type=Path, default=None, help="QA set (default ../shared/data/musique_s.json)")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--k", type=int, default=4, help="passages per request")
    parser.add_argument("--max-tokens", type=int, default=1024, help="what each request asks for at most")
    parser.add_argument("--kv-gib", type=float, default=0.5, help="--batch-kv-gb of both engines")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", type=Path, default=Path("bench-results/kv-admission.json"))
    args = parser.parse_args(argv)
    return run_and_write(args, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
