"""`python -m ragcache_lab.block_pool_decode`: a decode step over the block pool (`--kv-block-size`)
against the same step over buffers of their own, side by side in one process.

Each batch size prefills sequences of `--context` (+ b for the b-th) random tokens, their KV once as
buffers and once moved into a block pool of `--block-size` rows, and times the model's batched
decode step (`decode_batch`) over each, alternating the two `--rounds` times so machine noise
hits both alike. It also reports the largest difference of their logits (the same KV and
tokens: the two paths must agree). On a CPU the pooled attention is the torch reference; on a
GPU the Triton paged kernel against the batched one (CUDA graphs off for both). Prints a table
and writes JSON and Markdown (`--json`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine_sidecar.execution.batched_decode import DecodeKV, decode_batch
from engine_sidecar.execution.block_pool import BlockPool
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.paged_kv import PagedKV
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import FullPolicy
from engine_sidecar.model.runner import ModelRunner
from ragcache_lab.gpu import describe_machine
from ragcache_lab.report import run_and_write


def _buffers(runner: ModelRunner, batch: int, context: int) -> list[KVBuffer]:
    """The KV of `batch` prefills of random tokens, context + b of them for the b-th: the model's
    own keys and values (random ones give logits far from any real step's, where bf16 rounding
    alone moves them by whole units)."""
    gen = torch.Generator().manual_seed(batch)
    kvs = []
    for b in range(batch):
        ids = torch.randint(3, runner.config.vocab_size, (context + b,), generator=gen).tolist()
        plan = FusionPlan([PlanSpan("question", 0, tuple(ids), "fresh")], "full")
        kvs.append(fused_prefill(runner, plan, FullPolicy(), capacity=context + b + 64, need_logits=False).kv)
    return kvs


def _lengths(kvs: list[DecodeKV]) -> list[int]:
    return [kv.length for kv in kvs]


def _reset(kvs: list[DecodeKV], lengths: list[int]) -> None:
    """Back to the starting lengths (a paged table keeps the block a step took: it is reused)."""
    for kv, length in zip(kvs, lengths, strict=True):
        if isinstance(kv, PagedKV):
            kv.table.length = length
        else:
            kv.length = length


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step_s(runner: ModelRunner, kvs: list[DecodeKV], steps: int) -> float:
    """Median seconds of `steps` decode steps, each from the same starting lengths."""
    start, tokens = _lengths(kvs), list(range(100, 100 + len(kvs)))
    times = []
    decode_batch(runner, kvs, tokens)  # warm-up
    for _ in range(steps):
        _reset(kvs, start)
        _sync(runner.device)
        began = time.perf_counter()
        decode_batch(runner, kvs, tokens)
        _sync(runner.device)
        times.append(time.perf_counter() - began)
    _reset(kvs, start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    runner = ModelRunner.load(args.model, device=args.device, dtype=args.dtype)
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        buffers = _buffers(runner, batch, args.context)
        blocks_each = -(-(args.context + batch + 64) // args.block_size)
        pool = BlockPool(runner.config, runner.dtype, runner.device, block_size=args.block_size,
                         num_blocks=batch * blocks_each)
        paged: list[DecodeKV] = [PagedKV.from_buffer(pool, kv, kv.capacity) for kv in buffers]
        tokens = list(range(100, 100 + batch))
        start = _lengths(paged)
        with torch.inference_mode():
            difference = (decode_batch(runner, list(buffers), tokens).float()
                          - decode_batch(runner, paged, tokens).float()).abs().max().item()
            _reset(list(buffers), start)
            _reset(paged, start)
            seconds: dict[str, list[float]] = {"buffers": [], "paged": []}
            for _ in range(args.rounds):
                seconds["buffers"].append(_step_s(runner, list(buffers), args.steps))
                seconds["paged"].append(_step_s(runner, paged, args.steps))
        own, pooled = statistics.median(seconds["buffers"]), statistics.median(seconds["paged"])
        rows.append({"batch": batch, "buffers_step_ms": round(own * 1e3, 3), "paged_step_ms": round(pooled * 1e3, 3),
                     "paged_over_buffers": round(pooled / own, 3), "max_logit_difference": difference})
    return {"machine": describe_machine(runner.device), "dtype": args.dtype, "context": args.context,
            "block_size": args.block_size, "rows": rows}


def table(report: dict[str, Any]) -> str:
    machine = report["machine"]
    where = machine.get("name")
    if machine.get("cpu_flags"):
        where = f"{where} ({', '.join(machine['cpu_flags'])}), {machine.get('threads')} threads"
    lines = [f"Decode step, {report['dtype']}, ~{report['context']} tokens of context per sequence, blocks of "
             f"{report['block_size']} rows; {where}", "",
             "| sequences | buffers: step ms | block pool: step ms | pool / buffers | max logit difference |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['buffers_step_ms']} | {r['paged_step_ms']} | {r['paged_over_buffers']}x | "
              f"{r['max_logit_difference']:.2e} |" for r in report["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragcache_lab.block_pool_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the prepared SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8],
                        help="sequences per step, comma-separated")
    parser.add_argument("--context", type=int, default=1200, help="tokens of KV each sequence attends over")
    parser.add_argument("--block-size", type=int, default=16, help="rows per block of the pool")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two variants")
    parser.add_argument("--json", type=Path, default=Path("bench-results/block-pool-decode.json"))
    args = parser.parse_args(argv)
    if args.model is None:
        from engine_sidecar.model.prepare import resolve_model_dir

        args.model = resolve_model_dir("default")
    return run_and_write(args, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
