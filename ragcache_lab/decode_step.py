"""`python -m ragcache_lab.decode_step`: a CPU decode step with ragcache's native linear
layers against torch's GEMM, side by side in one process.

Each batch size runs the model's batched decode step (`decode_batch`) over sequences of
`--context` tokens of random KV, alternating the two variants `--rounds` times (so machine
noise hits both alike): the native small-M linear kernel as the engine uses it, and the same
step with that kernel off (its row limit set to 0 for the run), which is torch's GEMM for every
projection. Attention, RoPE and everything else are the same in both. Prints a table and writes
JSON and Markdown (`--json`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine_sidecar.execution.batched_decode import decode_batch
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.model.runner import ModelRunner
from ragcache_kernels import cpu_native
from ragcache_lab.gpu import describe_machine
from ragcache_lab.report import run_and_write


def _sequences(runner: ModelRunner, batch: int, context: int) -> list[KVBuffer]:
    gen = torch.Generator().manual_seed(batch)
    kvs = []
    for b in range(batch):
        kv = KVBuffer.allocate(runner, context + 64)
        for t in (kv.keys_pre, kv.keys, kv.values):
            t.copy_(torch.randn(t.shape, generator=gen))
        kv.length = context + b
        kvs.append(kv)
    return kvs


def _step_s(runner: ModelRunner, kvs: list[KVBuffer], steps: int) -> float:
    """Median seconds of `steps` decode steps, each from the same starting lengths."""
    start = [kv.length for kv in kvs]
    tokens = list(range(100, 100 + len(kvs)))
    times = []
    with torch.inference_mode():
        decode_batch(runner, kvs, tokens)  # warm-up
        for _ in range(steps):
            for kv, length in zip(kvs, start, strict=True):
                kv.length = length
            began = time.perf_counter()
            decode_batch(runner, kvs, tokens)
            times.append(time.perf_counter() - began)
    for kv, length in zip(kvs, start, strict=True):
        kv.length = length
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    runner = ModelRunner.load(args.model, device="cpu", dtype=args.dtype)
    native_rows = cpu_native.LINEAR_MAX_ROWS
    rows: list[dict[str, Any]] = []
    try:
        for batch in args.batch:
            kvs = _sequences(runner, batch, args.context)
            seconds: dict[str, list[float]] = {"native": [], "torch": []}
            for _ in range(args.rounds):
                for variant in ("torch", "native"):
                    cpu_native.LINEAR_MAX_ROWS = native_rows if variant == "native" else 0
                    seconds[variant].append(_step_s(runner, kvs, args.steps))
            native, plain = statistics.median(seconds["native"]), statistics.median(seconds["torch"])
            rows.append({"batch": batch, "torch_step_ms": round(plain * 1e3, 2),
                         "native_step_ms": round(native * 1e3, 2), "torch_tokens_per_s": round(batch / plain, 1),
                         "native_tokens_per_s": round(batch / native, 1), "speedup": round(plain / native, 2)})
    finally:
        cpu_native.LINEAR_MAX_ROWS = native_rows
    return {"machine": describe_machine(torch.device("cpu")), "dtype": args.dtype, "context": args.context,
            "native_max_rows": cpu_native.linear_max_rows(runner.dtype), "rows": rows}


def table(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [f"Decode step, {report['dtype']}, {report['context']} tokens of context per sequence; "
             f"{machine.get('name')} ({', '.join(machine.get('cpu_flags', []))}), {machine.get('threads')} threads",
             "", "| sequences | torch GEMM: step ms | tok/s | native linear: step ms | tok/s | speedup |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['torch_step_ms']} | {r['torch_tokens_per_s']} | {r['native_step_ms']} | "
              f"{r['native_tokens_per_s']} | {r['speedup']}x |" for r in report["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragcache_lab.decode_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the prepared SmolLM2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8],
                        help="sequences per step, comma-separated")
    parser.add_argument("--context", type=int, default=1200, help="tokens of KV each sequence attends over")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two variants")
    parser.add_argument("--json", type=Path, default=Path("bench-results/decode-step.json"))
    args = parser.parse_args(argv)
    if args.model is None:
        from engine_sidecar.model.prepare import resolve_model_dir

        args.model = resolve_model_dir("default")
    return run_and_write(args, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
