"""One entry point per kernel op: Triton on CUDA when it imports, the torch reference elsewhere.

Backend choice, first match wins:
1. the `backend=` argument of the call ("triton", "torch" or "auto"),
2. the environment variable RAGCACHE_KERNELS (same values; read on every call so tests and
   benchmarks can flip it),
3. "auto": Triton iff the tensors are on CUDA and `import triton` works; on CPU, bf16 attention
   goes to ragcache's own C kernel (kernels/cpu_native.py) where it is built and applies.

Forcing "triton" raises instead of silently falling back, so a benchmark or test that asked for
the kernel never measures the reference by mistake; on CPU it needs TRITON_INTERPRET=1 (the
interpreter, for tests). "auto" also falls back to torch where the kernel has a limit (too many
segments for the mass tiles) or where torch already has a better path (dense causal prefill,
which PyTorch's flash SDPA handles).

Triton modules are imported lazily: importing this module never imports triton.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from ragcache_kernels import attention as _attention
from ragcache_kernels import cpu_native as _cpu_native
from ragcache_kernels import kv as _kv
from ragcache_kernels import paged_decode as _paged_decode
from ragcache_kernels import rope as _rope
from ragcache_kernels._triton_common import MAX_MASS_SEGMENTS, rows_are_dense

if TYPE_CHECKING:
    from ragcache_kernels import triton_decode

Backend = Literal["triton", "torch"]
ENV_VAR = "RAGCACHE_KERNELS"
_CHOICES = ("triton", "torch", "auto")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (e.g. missing compiler bits) counts as absent
        return False
    return True


def _requested(backend: str | None) -> str:
    choice = (backend or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"kernel backend must be one of {_CHOICES}, got {choice!r}")
    return choice


def resolve_backend(device: torch.device | str, backend: str | None = None) -> Backend:
    """The backend a call on tensors of `device` would use (raises if a forced one cannot run)."""
    choice = _requested(backend)
    device = torch.device(device)
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}/backend forces triton but `import triton` fails (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"triton forced on {device.type} tensors: set TRITON_INTERPRET=1 (tests only) or use CUDA"
        )
    return "triton"


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
               backend: str | None = None) -> torch.Tensor:
    """RoPE (NeoX halves) of x [T, heads, D] or [layers, T, heads, D] by tables [T, D], into `out`
    when given. On a CPU in "auto", ragcache's native kernel: torch's result bit for bit in one
    pass, where torch makes four strided passes over a prompt's cached keys (docs/kernels.md);
    elsewhere the torch reference, `rope.apply_rope`."""
    if _requested(backend) == "auto" and x.device.type == "cpu":
        done = _cpu_native.rope(x, cos.to(x.dtype), sin.to(x.dtype), out)
        if done is not None:
            return done
    rotated = _rope.apply_rope(x, cos, sin)
    if out is None:
        return rotated
    return out.copy_(rotated)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """`residual + x @ weight^T + bias` (either may be None) for x [M, K], weight [N, K]. On a CPU
    in "auto", ragcache's native kernel for a decode step's few rows (the weights read once for
    every row, which beats the BLAS GEMM torch calls at so few rows: docs/benchmarks.md); torch's
    otherwise."""
    if _requested(backend) == "auto" and x.device.type == "cpu" and (bias is None or residual is None):
        done = _cpu_native.linear(x, weight, residual if residual is not None else bias)
        if done is not None:
            return done
    if residual is None:
        return F.linear(x, weight, bias)
    out = torch.addmm(residual, x, weight.t())
    return out if bias is None else out.add_(bias)


def rope_and_store(joint: torch.Tensor, num_heads: int, num_kv_heads: int, rows: torch.Tensor,
                   inv_freq: torch.Tensor, keys_pre: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> torch.Tensor:
    """The Triton kernel that stores a layer's k/v rows and rotates q and k in one launch
    (`triton_rope.rope_and_store`); callers check `resolve_backend(...) == "triton"` first."""
    from ragcache_kernels import triton_rope

    return triton_rope.rope_and_store(joint, num_heads, num_kv_heads, rows, inv_freq, keys_pre, keys, values)


def silu_mul(gate_up: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """SwiGLU's activation from the fused gate/up projection [M, 2I] -> [M, I]: one Triton launch on
    CUDA; torch's in-place silu and product elsewhere (in place on `gate_up`'s gate half)."""
    if resolve_backend(gate_up.device, backend) == "triton":
        from ragcache_kernels import triton_mlp

        return triton_mlp.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def rotate_keys(
    keys_pre: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    interleaved: bool = False,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pre-RoPE keys [T, heads, head_dim] rotated to global `positions` [T]; see rope.rotate_keys.

    Many chunks at once: concatenate their stored keys and pass one position per token
    (`rope.span_positions(starts, lengths)` builds them). Scaled RoPE (linear, llama3) is already
    folded into `inv_freq` by `rope.inv_frequencies`. `tables`: `rope.cos_sin(positions,
    inv_freq)` when the caller holds them already (the torch path then skips computing them;
    the Triton kernel computes its own in registers).
    """
    if resolve_backend(keys_pre.device, backend) == "triton":
        from ragcache_kernels import triton_rope

        return triton_rope.rotate_keys(keys_pre, positions, inv_freq, interleaved, out)
    if not interleaved:
        cos, sin = tables if tables is not None else _rope.cos_sin(positions, inv_freq)
        return apply_rope(keys_pre, cos, sin, out, backend)
    return _rope.rotate_keys(keys_pre, positions, inv_freq, interleaved, out, tables)


def selective_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor | None,
    sliding_window: int | None = None,
    dense_causal: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of queries at arbitrary positions over all keys with key_pos <= query_pos.

    Same contract as attention.selective_attention (q [Tq, H, D], k/v [Tk, Hkv, D] -> [Tq, H, D]).
    `key_pos` None: key i is at position i, which the Triton kernel turns into loops without
    branches. A query that sees no key returns NaN on the torch path and zeros on the Triton path.
    """
    choice = _requested(backend)
    if key_pos is None and resolve_backend(q.device, choice) == "triton" and not dense_causal:
        from ragcache_kernels import triton_attention

        return triton_attention.selective_attention(q, k, v, query_pos, None, sliding_window)[0]
    if key_pos is None:
        key_pos = torch.arange(k.shape[0], device=k.device)
    if choice == "auto" and q.device.type == "cpu" and _cpu_native.prefers_native(q.dtype, dense_causal):
        out = _native_prefill(q, k, v, query_pos, key_pos, sliding_window)
        if out is not None:
            return out
    if choice == "auto" and dense_causal:
        choice = "torch"
    if resolve_backend(q.device, choice) == "triton":
        from ragcache_kernels import triton_attention

        return triton_attention.selective_attention(q, k, v, query_pos, key_pos, sliding_window)[0]
    return _attention.selective_attention(q, k, v, query_pos, key_pos, sliding_window, dense_causal)


def _native_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                    key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor | None:
    """ragcache's own CPU kernel (bf16 on AVX512-BF16, fp32 on AVX2) where it applies: no sliding
    window, key positions ascending (the fused prefill's layout); None sends the call to torch."""
    if q.dtype not in _cpu_native.KERNELS or sliding_window is not None:
        return None
    if key_pos.shape[0] > 1 and not bool((key_pos[1:] >= key_pos[:-1]).all()):
        return None
    return _cpu_native.prefill_attention(q, k, v, query_pos, key_pos)


def decode_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     backend: str | None = None) -> torch.Tensor | None:
    """One new query per sequence, q [B, H, D], over that sequence's keys/values [n_b, Hkv, D]
    (all visible) -> [B, H * D] from ragcache's native CPU kernel, or None: the caller then runs
    its per-sequence torch path. Only "auto" uses the native kernel ("torch" forces the reference)."""
    if _requested(backend) != "auto" or q.device.type != "cpu" or q.dtype not in _cpu_native.KERNELS:
        return None
    return _cpu_native.decode_attention(q, keys, values)


def batched_decode(keys_pre: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
                   positions: list[int], sliding_window: int | None = None,
                   backend: str | None = None) -> triton_decode.DecodeBatch | None:
    """A decode step's table for the Triton batched kernels (one launch per layer appends every
    sequence's new rows, one attends every sequence's query), or None: the caller then writes
    and attends sequence by sequence. Buffers are [layers, capacity, kv_heads, head_dim] per
    sequence; sequence b's new row goes at positions[b]."""
    if resolve_backend(keys[0].device, backend) != "triton":
        return None
    if not all(t.is_contiguous() for group in (keys_pre, keys, values) for t in group):
        return None
    from ragcache_kernels import triton_decode as batched

    return batched.decode_batch_table(keys_pre, keys, values, positions, sliding_window)


def paged_decode_attention(q: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                           window: int | None = None, backend: str | None = None) -> torch.Tensor:
    """One decode query per sequence, q [B, Hq, D], over its rows of one layer's block pool
    (key/value blocks [num_blocks, block_size, Hkv, D]) through block_tables [B, max_blocks] and
    lengths [B] -> [B, Hq, D]; the last `window` rows only with a sliding window. The Triton
    kernel on CUDA, the torch reference (`paged_decode`) elsewhere."""
    if resolve_backend(q.device, backend) == "triton":
        from ragcache_kernels import triton_paged_decode

        return triton_paged_decode.paged_decode_attention(q, key_blocks, value_blocks, block_tables, lengths,
                                                          scale, window)
    return _paged_decode.paged_decode_attention_reference(q, key_blocks, value_blocks, block_tables, lengths,
                                                          scale, window)


def selective_attention_with_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    segment_ids: torch.Tensor,
    num_segments: int,
    sliding_window: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Tq, H, D], mass [Tq, num_segments] fp32): attention plus head-averaged mass per segment.

    segment_ids [Tk] gives each key's segment (e.g. its chunk; `attention.segment_ids_from_boundaries`
    builds it from chunk starts); ids outside [0, num_segments) are in no segment.
    """
    choice = _requested(backend)
    if choice == "auto" and num_segments > MAX_MASS_SEGMENTS:
        choice = "torch"
    if resolve_backend(q.device, choice) == "triton":
        from ragcache_kernels import triton_attention

        out, mass = triton_attention.selective_attention(
            q, k, v, query_pos, key_pos, sliding_window, segment_ids=segment_ids, num_segments=num_segments
        )
        assert mass is not None
        return out, mass
    return _attention.selective_attention_with_mass(
        q, k, v, query_pos, key_pos, segment_ids, num_segments, sliding_window
    )


def kv_deviation(
    new: torch.Tensor,
    cached: torch.Tensor,
    cached_index: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Per-token deviation [T] fp32: sum over heads of the L2 norm over head_dim of new - cached."""
    if resolve_backend(new.device, backend) == "triton":
        from ragcache_kernels import triton_kv

        return triton_kv.kv_deviation(new, cached, cached_index, accumulate)
    return _kv.kv_deviation(new, cached, cached_index, accumulate)


def kv_deviation_topk(
    k_new: torch.Tensor,
    k_cached: torch.Tensor,
    v_new: torch.Tensor | None,
    v_cached: torch.Tensor | None,
    k: int,
    cached_index: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CacheBlend's check-layer pick: (top-k token indices in ascending order, deviation [T]).

    Deviation is the K deviation plus, when v tensors are given, the V deviation.
    """
    deviation = kv_deviation(k_new, k_cached, cached_index, backend=backend)
    if v_new is not None and v_cached is not None:
        deviation = kv_deviation(v_new, v_cached, cached_index, accumulate=deviation, backend=backend)
    return _kv.topk_tokens(deviation, k), deviation


def scatter_backend(device: torch.device | str, dense_rows: bool, backend: str | None = None) -> Backend:
    """Where a row scatter runs. "auto" is torch's index_copy_ on every device: on an H100 it took
    half the Triton kernel's time, and a Triton launch costs more host time than an aten one (its
    Python launcher). The Triton kernel runs when forced, on destinations with dense rows."""
    choice = _requested(backend)
    if choice == "auto" or not dense_rows:
        return "torch"
    return resolve_backend(device, choice)


def scatter_rows(
    dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, backend: str | None = None
) -> torch.Tensor:
    """dst[index[i]] = src[i] in place along dim 0 (index_copy semantics; unique indices)."""
    if scatter_backend(dst.device, rows_are_dense(dst), backend) == "triton":
        from ragcache_kernels import triton_kv

        return triton_kv.scatter_rows(dst, index, src)
    return _kv.scatter_rows(dst, index, src)
