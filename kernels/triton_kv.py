"""Triton KV deviation (CacheBlend check layer) and row scatter into the assembled KV buffer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ragcache_kernels._triton_common import check_device, rows_are_dense


@triton.jit(do_not_specialize=["num_tokens"])
def _deviation_kernel(
    NEW,
    CACHED,
    CACHED_INDEX,
    OUT,
    num_tokens,
    num_heads,
    stride_nt,
    stride_nh,
    stride_ct,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < num_tokens
    mask = t_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if HAS_INDEX:
        # Compare against the cached rows of the selected tokens without gathering them first.
        cached_rows = tl.load(CACHED_INDEX + offs_t, mask=t_ok, other=0).to(tl.int64)
    else:
        cached_rows = offs_t.to(tl.int64)
    new_base = NEW + offs_t.to(tl.int64)[:, None] * stride_nt + offs_d[None, :]
    cached_base = CACHED + cached_rows[:, None] * stride_ct + offs_d[None, :]
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for h in range(num_heads):
        a = tl.load(new_base + h * stride_nh, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(cached_base + h * stride_ch, mask=mask, other=0.0).to(tl.float32)
        diff = a - b
        total += tl.sqrt(tl.sum(diff * diff, axis=1))
    if ACCUMULATE:
        total += tl.load(OUT + offs_t, mask=t_ok, other=0.0)
    tl.store(OUT + offs_t, total, mask=t_ok)


def kv_deviation(
    new: torch.Tensor,
    cached: torch.Tensor,
    cached_index: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    block_t: int = 32,
) -> torch.Tensor:
    """Triton version of `ragcache_kernels.kv.kv_deviation` (same arguments and result)."""
    if new.dim() != 3 or cached.dim() != 3 or new.shape[1:] != cached.shape[1:]:
        raise ValueError(f"expected [T, H, D] tensors, got {tuple(new.shape)} and {tuple(cached.shape)}")
    if cached_index is None and cached.shape[0] != new.shape[0]:
        raise ValueError("without cached_index, new and cached need the same number of tokens")
    new, cached = (t if t.stride(-1) == 1 else t.contiguous() for t in (new, cached))
    check_device(new, cached)
    num_tokens, num_heads, head_dim = new.shape
    if accumulate is None:
        out = torch.empty(num_tokens, dtype=torch.float32, device=new.device)
    else:
        if (
            accumulate.shape != (num_tokens,)
            or accumulate.dtype != torch.float32
            or not accumulate.is_contiguous()
        ):
            raise ValueError("accumulate must be a contiguous fp32 [T] tensor")
        out = accumulate
    if num_tokens == 0:
        return out
    index = (
        cached_index.to(device=new.device, dtype=torch.int64).contiguous()
        if cached_index is not None
        else torch.empty(1, dtype=torch.int64, device=new.device)
    )
    grid = (triton.cdiv(num_tokens, block_t),)
    _deviation_kernel[grid](
        new,
        cached,
        index,
        out,
        num_tokens,
        num_heads,
        new.stride(0),
        new.stride(1),
        cached.stride(0),
        cached.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=block_t,
        HAS_INDEX=cached_index is not None,
        ACCUMULATE=accumulate is not None,
    )
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _scatter_rows_kernel(
    DST,
    SRC,
    INDEX,
    num_rows,
    row_size,
    stride_dst,
    stride_src,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = offs_t < num_rows
    mask = t_ok[:, None] & (offs_c[None, :] < row_size)
    rows = tl.load(INDEX + offs_t, mask=t_ok, other=0).to(tl.int64)
    vals = tl.load(SRC + offs_t.to(tl.int64)[:, None] * stride_src + offs_c[None, :], mask=mask)
    tl.store(DST + rows[:, None] * stride_dst + offs_c[None, :], vals, mask=mask)


def scatter_rows(
    dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, block_t: int = 16, block_c: int = 256
) -> torch.Tensor:
    """Triton version of `ragcache_kernels.kv.scatter_rows`: dst[index[i]] = src[i], in place.

    dst may be a view (e.g. one layer of a [layers, tokens, heads, dim] buffer) as long as each of
    its rows is dense; indices must be unique and in range (not checked on the device).
    """
    if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
        raise ValueError("src rows must match dst rows in shape and dtype")
    if index.numel() != src.shape[0]:
        raise ValueError("one index per src row")
    if not rows_are_dense(dst):
        raise ValueError("dst rows must be dense in memory (use the torch path for other layouts)")
    if not rows_are_dense(src):
        src = src.contiguous()
    check_device(dst, src)
    num_rows = src.shape[0]
    row_size = src[0].numel() if num_rows else 0
    if num_rows == 0 or row_size == 0:
        return dst
    index = index.to(device=dst.device, dtype=torch.int64).contiguous()
    block_c = min(block_c, triton.next_power_of_2(row_size))
    grid = (triton.cdiv(num_rows, block_t), triton.cdiv(row_size, block_c))
    _scatter_rows_kernel[grid](
        dst, src, index, num_rows, row_size, dst.stride(0), src.stride(0), BLOCK_T=block_t, BLOCK_C=block_c
    )
    return dst
