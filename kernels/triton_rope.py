"""Triton RoPE re-rotation: pre-RoPE keys of many chunks placed at arbitrary positions in one launch.

One program handles a block of tokens and loops over heads, so the cos/sin of a token (the costly
part next to the memory traffic) are computed once and reused for every head. Maths is in fp32
with a single rounding to the output dtype; the torch reference rounds cos/sin and each product to
the activation dtype (Hugging Face's convention), so fp16/bf16 results differ by a few ulps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ragcache_kernels._triton_common import check_device


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_kernel(
    X,
    OUT,
    POS,
    INV_FREQ,
    num_tokens,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, BLOCK_HALF)
    t_ok = offs_t < num_tokens
    i_ok = offs_i < HALF
    mask = t_ok[:, None] & i_ok[None, :]

    pos = tl.load(POS + offs_t, mask=t_ok, other=0).to(tl.float32)
    inv = tl.load(INV_FREQ + offs_i, mask=i_ok, other=0.0)
    angle = pos[:, None] * inv[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)

    # Pair i rotates by frequency i in both layouts; only where its two members live differs.
    if INTERLEAVED:
        first = 2 * offs_i
        second = first + 1
    else:
        first = offs_i
        second = offs_i + HALF

    # int64 row offsets: an assembled KV buffer can exceed 2**31 elements.
    x_rows = X + offs_t.to(tl.int64)[:, None] * stride_xt
    o_rows = OUT + offs_t.to(tl.int64)[:, None] * stride_ot
    for h in range(num_heads):
        x1 = tl.load(x_rows + h * stride_xh + first[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rows + h * stride_xh + second[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(o_rows + h * stride_oh + first[None, :], o1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_rows + h * stride_oh + second[None, :], o2.to(OUT.dtype.element_ty), mask=mask)


def rotate_keys(
    keys_pre: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    interleaved: bool = False,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
) -> torch.Tensor:
    """Triton version of `ragcache_kernels.rope.rotate_keys` (same arguments and result).

    `out` may alias `keys_pre` (in-place rotation is safe: each element is read before it is
    written by the same program) or be a strided slice of a larger buffer.
    """
    if keys_pre.dim() != 3:
        raise ValueError(f"keys_pre must be [T, heads, head_dim], got {tuple(keys_pre.shape)}")
    num_tokens, num_heads, head_dim = keys_pre.shape
    if head_dim % 2:
        raise ValueError("head_dim must be even for RoPE")
    if keys_pre.stride(-1) != 1:
        keys_pre = keys_pre.contiguous()
    if out is None:
        out = torch.empty_like(keys_pre, memory_format=torch.contiguous_format)
    elif out.shape != keys_pre.shape or out.stride(-1) != 1:
        raise ValueError("out must have the input's shape and a contiguous last axis")
    check_device(keys_pre, out)
    if num_tokens == 0:
        return out
    half = head_dim // 2
    positions = positions.to(device=keys_pre.device, dtype=torch.int64).contiguous()
    inv_freq = inv_freq.to(device=keys_pre.device, dtype=torch.float32).contiguous()
    if inv_freq.numel() != half:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries, expected head_dim/2 = {half}")
    # fp32 rows of 128-wide heads at 32 rows a program spill a few registers on sm_90
    block_t = block_t or (16 if keys_pre.dtype == torch.float32 and half > 32 else 32)
    grid = (triton.cdiv(num_tokens, block_t),)
    _rope_kernel[grid](
        keys_pre,
        out,
        positions,
        inv_freq,
        num_tokens,
        num_heads,
        keys_pre.stride(0),
        keys_pre.stride(1),
        out.stride(0),
        out.stride(1),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_T=block_t,
        INTERLEAVED=interleaved,
    )
    return out
