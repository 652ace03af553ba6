"""Microbenchmark: Triton kernels vs the torch reference (and PyTorch SDPA), in tokens per second.

    python -m ragcache_kernels.bench                       # SmolLM2 shapes, 2,048 keys
    python -m ragcache_kernels.bench --model llama8b --tokens 8192 --ratio 0.15

On CUDA with triton installed every op is timed on both backends. On a CPU, ragcache's native CPU
attention is timed beside the torch rows where it runs: bf16 (the default dtype here) on AVX512-BF16,
fp32 (`--dtype float32`) on AVX2.
Otherwise only the torch reference path is timed (the Triton interpreter exists for correctness, its speed means
nothing), and the output says so. Results print as a table and are written as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ragcache_kernels import cpu_native, dispatch
from ragcache_kernels.attention import segment_ids_from_boundaries
from ragcache_kernels.rope import inv_frequencies

# a decode step's weight matrices (N, K) per model: q/k/v, gate/up, down, the logits
LINEAR_SHAPES: dict[str, tuple[tuple[int, int], ...]] = {
    "smollm2": ((960, 576), (3072, 576), (576, 1536), (49152, 576)),
    "llama8b": ((6144, 4096), (28672, 4096), (4096, 14336)),
}
# (query heads, kv heads, head_dim, rope theta)
MODELS: dict[str, tuple[int, int, int, float]] = {
    "smollm2": (9, 3, 64, 1e5),  # the default model of this project
    "llama8b": (32, 8, 128, 5e5),  # a typical GQA-8 production shape
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Row:
    op: str
    impl: str
    shape: str
    tokens: int  # tokens processed per call (queries for attention)
    ms: float  # median over repeats
    tokens_per_s: float
    speedup_vs_reference: float | None = None


def _timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time in ms; synchronises CUDA so the kernel, not its launch, is measured."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@dataclass(frozen=True)
class _Inputs:
    """The tensors every op is timed on, drawn once from one seeded generator so runs compare."""

    heads: int
    kv_heads: int
    head_dim: int
    num_keys: int
    num_queries: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_pos: torch.Tensor
    query_idx: torch.Tensor
    query_pos: torch.Tensor
    segments: torch.Tensor
    num_segments: int
    inv_freq: torch.Tensor
    k_new: torch.Tensor
    buffer: torch.Tensor
    recomputed: torch.Tensor
    full_q: torch.Tensor  # a query for every token, (tokens, heads, head_dim): the dense causal peers
    attn: str  # shape label of the attention ops
    kv_shape: str  # shape label of the ops over the whole KV


OpFactory = Callable[[str], Callable[[], object]]


def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    kernels_timed = device.type == "cuda" and dispatch.triton_available()
    impls = ["torch", "triton"] if kernels_timed else ["torch"]
    x = _inputs(args, device, dtype)
    rows = _op_rows(_ops(x), impls, device, args)
    reference_attention = next(r.ms for r in rows if r.op == "selective_attention" and r.impl == "torch")
    rows += _peer_rows(x, reference_attention, device, args)
    if device.type == "cpu" and dtype in cpu_native.KERNELS and cpu_native.available(dtype):
        rows += _native_rows(x.q, x.k, x.v, x.query_pos, x.key_pos, x.full_q, reference_attention, rows, args)
        rows += _native_linear_rows(dtype, args)
    return _report(args, device, kernels_timed, rows)


def _inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> _Inputs:
    """The model's attention shapes at `args.tokens` keys, `args.ratio` of them recomputed."""
    heads, kv_heads, head_dim, theta = MODELS[args.model]
    num_keys = args.tokens
    num_queries = max(1, round(args.ratio * num_keys))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    key_pos = torch.arange(num_keys, device=device)
    # Recompute-style queries: a scattered subset of the prompt's tokens, in position order.
    query_idx = torch.randperm(num_keys, generator=gen)[:num_queries].sort().values.to(device)
    q, k, v = (
        rand(num_queries, heads, head_dim),
        rand(num_keys, kv_heads, head_dim),
        rand(num_keys, kv_heads, head_dim),
    )
    chunk = max(1, num_keys // args.chunks)
    segments = segment_ids_from_boundaries(torch.arange(0, num_keys, chunk, device=device), num_keys)
    num_segments = int(segments.max()) + 1
    k_new = k + 0.1 * rand(num_keys, kv_heads, head_dim)
    return _Inputs(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        num_keys=num_keys,
        num_queries=num_queries,
        q=q,
        k=k,
        v=v,
        key_pos=key_pos,
        query_idx=query_idx,
        query_pos=key_pos[query_idx],
        segments=segments,
        num_segments=num_segments,
        inv_freq=inv_frequencies(head_dim, theta).to(device),
        k_new=k_new,
        buffer=torch.zeros(num_keys, kv_heads, head_dim, device=device, dtype=dtype),
        recomputed=k[:num_queries],
        full_q=rand(num_keys, heads, head_dim),
        attn=f"q={num_queries} k={num_keys} h={heads}/{kv_heads} d={head_dim}",
        kv_shape=f"t={num_keys} h={kv_heads} d={head_dim}",
    )


def _ops(x: _Inputs) -> list[tuple[str, str, int, OpFactory]]:
    """Each op as (name, shape label, tokens per call, backend -> timed call)."""
    return [
        (
            "rope_rotate",
            x.kv_shape,
            x.num_keys,
            lambda b: lambda: dispatch.rotate_keys(x.k, x.key_pos, x.inv_freq, backend=b),
        ),
        (
            "selective_attention",
            x.attn,
            x.num_queries,
            lambda b: lambda: dispatch.selective_attention(x.q, x.k, x.v, x.query_pos, x.key_pos, backend=b),
        ),
        (
            "attention_with_mass",
            x.attn + f" segs={x.num_segments}",
            x.num_queries,
            lambda b: (
                lambda: dispatch.selective_attention_with_mass(
                    x.q, x.k, x.v, x.query_pos, x.key_pos, x.segments, x.num_segments, backend=b
                )
            ),
        ),
        (
            "kv_deviation_topk",
            x.kv_shape,
            x.num_keys,
            lambda b: (
                lambda: dispatch.kv_deviation_topk(x.k_new, x.k, x.k_new, x.k, x.num_queries, backend=b)
            ),
        ),
        (
            "scatter_rows",
            f"rows={x.num_queries} into {x.num_keys}",
            x.num_queries,
            lambda b: lambda: dispatch.scatter_rows(x.buffer, x.query_idx, x.recomputed, backend=b),
        ),
    ]


def _op_rows(
    ops: list[tuple[str, str, int, OpFactory]],
    impls: list[str],
    device: torch.device,
    args: argparse.Namespace,
) -> list[Row]:
    """Every op on every backend, each row's speedup against the torch reference of that op."""
    rows: list[Row] = []
    for op, shape, tokens, make in ops:
        reference_ms = None
        for impl in impls:
            ms = _timed(make(impl), device, args.warmup, args.repeats)
            reference_ms = ms if impl == "torch" else reference_ms
            speedup = reference_ms / ms if reference_ms else None
            rows.append(Row(op, impl, shape, tokens, ms, tokens / (ms / 1e3), speedup))
    return rows


def _peer_rows(x: _Inputs, reference_ms: float, device: torch.device, args: argparse.Namespace) -> list[Row]:
    """Peers for attention: what one would do without a position-aware kernel."""
    qh, kh, vh = x.q.transpose(0, 1)[None], x.k.transpose(0, 1)[None], x.v.transpose(0, 1)[None]
    gqa = x.heads != x.kv_heads
    full_q = x.full_q.transpose(0, 1)[None]
    peers: list[tuple[str, str, int, Callable[[], object]]] = [
        (
            "sdpa_dense_causal_all_tokens",
            f"q={x.num_keys} k={x.num_keys}",
            x.num_keys,
            lambda: F.scaled_dot_product_attention(full_q, kh, vh, is_causal=True, enable_gqa=gqa),
        ),
        (
            "sdpa_no_mask_subset",
            x.attn,
            x.num_queries,
            lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa),
        ),
    ]
    rows: list[Row] = []
    for name, shape, tokens, fn in peers:
        ms = _timed(fn, device, args.warmup, args.repeats)
        rows.append(
            Row("selective_attention", name, shape, tokens, ms, tokens / (ms / 1e3), reference_ms / ms)
        )
    return rows


def _report(
    args: argparse.Namespace, device: torch.device, kernels_timed: bool, rows: list[Row]
) -> dict[str, object]:
    """The rows with what they were measured on, and a note saying which backends were timed."""
    if kernels_timed:
        note = "CUDA: Triton kernels and torch reference both timed"
    else:
        note = (
            f"{device.type}: only the torch reference path is timed (Triton needs CUDA; its CPU "
            "interpreter is for correctness tests, not speed)"
        )
    return {
        "note": note,
        "kernels_timed": kernels_timed,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "triton_available": dispatch.triton_available(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": [asdict(r) for r in rows],
        "engine_uses": _engine_choice(args) if device.type == "cpu" else None,
    }


def _engine_choice(args: argparse.Namespace) -> dict[str, object]:
    """What the engine picks on this CPU in "auto" for the timed dtype (cpu_native.prefers_native):
    the rows above may time a native kernel the engine leaves aside here."""
    dtype = DTYPES[args.dtype]
    usable = cpu_native.available(dtype)
    return {
        "scattered_prefill_attention": "native" if usable and cpu_native.prefers_native(dtype, False) else "torch",
        "dense_prefill_attention": "native" if usable and cpu_native.prefers_native(dtype, True) else "torch",
        "native_linear_max_rows": cpu_native.linear_max_rows(dtype) if usable else 0,
    }


def _native_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                 full_q: torch.Tensor, reference_ms: float, rows: list[Row], args: argparse.Namespace) -> list[Row]:
    """ragcache's native CPU attention (bf16 on AVX512-BF16, fp32 on AVX2) beside the torch rows above: the same
    scattered queries, every token causally (vs PyTorch's causal SDPA), and one decode step for 8
    sequences (vs one torch call per sequence, as the executor does without the kernel)."""
    cpu = torch.device("cpu")
    num_keys, kv_heads, head_dim = k.shape
    heads = q.shape[1]
    out: list[Row] = []
    ms = _timed(lambda: cpu_native.prefill_attention(q, k, v, query_pos, key_pos), cpu, args.warmup, args.repeats)
    out.append(Row("selective_attention", "native_cpu", f"q={q.shape[0]} k={num_keys} h={heads}/{kv_heads} d={head_dim}",
                   q.shape[0], ms,
                   q.shape[0] / (ms / 1e3), reference_ms / ms))
    dense_ms = next(r.ms for r in rows if r.impl == "sdpa_dense_causal_all_tokens")
    ms = _timed(lambda: cpu_native.prefill_attention(full_q, k, v, key_pos, key_pos), cpu, args.warmup, args.repeats)
    out.append(Row("selective_attention", "native_cpu_dense_causal", f"q={num_keys} k={num_keys}", num_keys, ms,
                   num_keys / (ms / 1e3), dense_ms / ms))
    group, scale = heads // kv_heads, head_dim**-0.5
    queries = torch.randn(8, heads, head_dim).to(q.dtype)
    keys, values = [k] * 8, [v] * 8

    def per_sequence() -> None:
        for i in range(8):
            scores = torch.matmul(keys[i].transpose(0, 1), queries[i].view(kv_heads, group, head_dim).transpose(1, 2))
            probs = torch.softmax(scores.float().mul_(scale), dim=1).to(v.dtype)
            torch.matmul(probs.transpose(1, 2), values[i].transpose(0, 1))

    torch_ms = _timed(per_sequence, cpu, args.warmup, args.repeats)
    out.append(Row("decode_attention", "torch_per_sequence", f"8 seqs x k={num_keys}", 8, torch_ms,
                   8 / (torch_ms / 1e3), 1.0))
    ms = _timed(lambda: cpu_native.decode_attention(queries, keys, values), cpu, args.warmup, args.repeats)
    out.append(Row("decode_attention", "native_cpu", f"8 seqs x k={num_keys}", 8, ms, 8 / (ms / 1e3), torch_ms / ms))
    return out


def _native_linear_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[Row]:
    """A decode step's linear layers (`residual + x W^T`) for 1, 4 and 8 rows: torch's GEMM against
    the native small-M kernel (timed up to its limit even where the engine hands fewer rows to it,
    `cpu_native.linear_max_rows`). Several copies of each weight are
    used in turn, so the weights come from memory as in a real step, not from the cache."""
    out: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    for n, k in LINEAR_SHAPES[args.model]:
        copies = max(1, min(8, (64 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(copies)]
        for rows in (1, 4, 8):
            if rows <= cpu_native.LINEAR_MAX_ROWS:
                out += _linear_pair(weights, rows, args)
    return out


def _linear_pair(weights: list[torch.Tensor], rows: int, args: argparse.Namespace) -> list[Row]:
    """torch's `addmm` and the native kernel over every copy of one weight, per copy."""
    cpu = torch.device("cpu")
    n, k = weights[0].shape
    x, residual = torch.randn(rows, k).to(weights[0].dtype), torch.randn(rows, n).to(weights[0].dtype)

    def with_torch() -> None:
        for w in weights:
            torch.addmm(residual, x, w.t())

    def with_kernel() -> None:
        for w in weights:
            cpu_native.linear(x, w, residual, max_rows=cpu_native.LINEAR_MAX_ROWS)

    torch_ms = _timed(with_torch, cpu, args.warmup, args.repeats) / len(weights)
    native_ms = _timed(with_kernel, cpu, args.warmup, args.repeats) / len(weights)
    shape = f"m={rows} n={n} k={k}"
    return [Row("decode_linear", "torch", shape, rows, torch_ms, rows / (torch_ms / 1e3), 1.0),
            Row("decode_linear", "native_cpu", shape, rows, native_ms, rows / (native_ms / 1e3), torch_ms / native_ms)]


def print_table(report: dict[str, object]) -> None:
    print(f"# {report['note']}")
    print(f"# device={report['device']} torch={report['torch']} threads={report['torch_threads']}")
    if report.get("engine_uses"):
        print("# the engine on this CPU uses: " + ", ".join(f"{k}={v}" for k, v in report["engine_uses"].items()))  # type: ignore[union-attr]
    header = f"{'op':<22} {'impl':<30} {'shape':<34} {'ms':>9} {'tokens/s':>12} {'vs ref':>7}"
    print(header)
    print("-" * len(header))
    for r in report["results"]:  # type: ignore[union-attr]
        speed = f"{r['speedup_vs_reference']:.2f}x" if r["speedup_vs_reference"] else "-"
        print(
            f"{r['op']:<22} {r['impl']:<30} {r['shape']:<34} {r['ms']:>9.3f} {r['tokens_per_s']:>12,.0f} {speed:>7}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--tokens", type=int, default=2048, help="keys in the assembled KV (prompt length)")
    parser.add_argument("--ratio", type=float, default=0.15, help="share of tokens recomputed (queries)")
    parser.add_argument("--chunks", type=int, default=8, help="segments for the attention-mass op")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench-results/kernels.json"))
    args = parser.parse_args(argv)
    report = run(args)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
