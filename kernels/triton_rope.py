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
    stride_xl,
    stride_xt,
    stride_xh,
    stride_ol,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)  # [layers, T, heads, D] inputs: one grid row per layer
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
    x_rows = X + layer * stride_xl + offs_t.to(tl.int64)[:, None] * stride_xt
    o_rows = OUT + layer * stride_ol + offs_t.to(tl.int64)[:, None] * stride_ot
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
    written by the same program) or be a strided slice of a larger buffer. `keys_pre` may also be
    [layers, T, heads, head_dim] (every layer's keys at the same positions, in one launch).
    """
    if keys_pre.dim() not in (3, 4):
        raise ValueError(f"keys_pre must be [T, heads, head_dim] or [layers, T, heads, head_dim], "
                         f"got {tuple(keys_pre.shape)}")
    num_tokens, num_heads, head_dim = keys_pre.shape[-3:]
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
    layers = keys_pre.shape[0] if keys_pre.dim() == 4 else 1
    grid = (triton.cdiv(num_tokens, block_t), layers)
    _rope_kernel[grid](
        keys_pre,
        out,
        positions,
        inv_freq,
        num_tokens,
        num_heads,
        keys_pre.stride(0) if keys_pre.dim() == 4 else 0,
        keys_pre.stride(-3),
        keys_pre.stride(-2),
        out.stride(0) if out.dim() == 4 else 0,
        out.stride(-3),
        out.stride(-2),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_T=block_t,
        INTERLEAVED=interleaved,
    )
    return out


@triton.jit(do_not_specialize=["num_rows", "num_stored"])
def rope_store_kernel(
    QKV,
    Q_OUT,
    K_PRE,
    K_ROT,
    V,
    ROWS,
    INV_FREQ,
    num_rows,
    num_stored,
    stride_src,
    stride_qt,
    stride_qh,
    stride_dt,
    stride_dh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """This program's block of rows: q rotated into Q_OUT (rows below `num_rows`), and for the
    first `num_stored` rows k as computed into K_PRE, k rotated into K_ROT and v into V, each at
    its row's own index there."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, BLOCK_HALF)
    t_ok = offs_t < num_rows
    i_ok = offs_i < HALF
    mask = t_ok[:, None] & i_ok[None, :]
    stored = (offs_t < num_stored)[:, None] & mask
    row = tl.load(ROWS + offs_t, mask=t_ok, other=0)  # a prompt row is also its position
    inv = tl.load(INV_FREQ + offs_i, mask=i_ok, other=0.0)
    angle = row.to(tl.float32)[:, None] * inv[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    src = QKV + offs_t.to(tl.int64)[:, None] * stride_src
    q_out = Q_OUT + offs_t.to(tl.int64)[:, None] * stride_qt
    dst = row.to(tl.int64)[:, None] * stride_dt
    for h in range(NUM_HEADS):
        x1 = tl.load(src + h * HEAD_DIM + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * HEAD_DIM + HALF + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(q_out + h * stride_qh + offs_i[None, :], (x1 * cos - x2 * sin).to(Q_OUT.dtype.element_ty), mask=mask)
        tl.store(q_out + h * stride_qh + HALF + offs_i[None, :], (x2 * cos + x1 * sin).to(Q_OUT.dtype.element_ty),
                 mask=mask)
    for h in range(NUM_KV_HEADS):
        k_src = src + (NUM_HEADS + h) * HEAD_DIM
        k1 = tl.load(k_src + offs_i[None, :], mask=mask, other=0.0)
        k2 = tl.load(k_src + HALF + offs_i[None, :], mask=mask, other=0.0)
        at = dst + h * stride_dh
        tl.store(K_PRE + at + offs_i[None, :], k1, mask=stored)  # position-free, as computed
        tl.store(K_PRE + at + HALF + offs_i[None, :], k2, mask=stored)
        f1, f2 = k1.to(tl.float32), k2.to(tl.float32)
        tl.store(K_ROT + at + offs_i[None, :], (f1 * cos - f2 * sin).to(K_ROT.dtype.element_ty), mask=stored)
        tl.store(K_ROT + at + HALF + offs_i[None, :], (f2 * cos + f1 * sin).to(K_ROT.dtype.element_ty), mask=stored)
        v_src = src + (NUM_HEADS + NUM_KV_HEADS + h) * HEAD_DIM
        tl.store(V + at + offs_i[None, :], tl.load(v_src + offs_i[None, :], mask=mask, other=0.0), mask=stored)
        tl.store(V + at + HALF + offs_i[None, :], tl.load(v_src + HALF + offs_i[None, :], mask=mask, other=0.0),
                 mask=stored)


def rope_and_store(joint: torch.Tensor, num_heads: int, num_kv_heads: int, rows: torch.Tensor,
                   inv_freq: torch.Tensor, keys_pre: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> torch.Tensor:
    """One layer's fused q/k/v projection of some prompt rows [A, (H + 2 Hkv) D] (NeoX RoPE) in one
    launch: k as computed into `keys_pre` [T, Hkv, D] at `rows`, k rotated to its row's position
    into `keys`, v into `values`; returns q rotated [A, H, D]. Row r of the prompt is at position r.
    The same values as rotating q and k (rotate_keys) and writing the three rows one by one."""
    heads = num_heads + 2 * num_kv_heads
    if joint.dim() != 2 or joint.shape[1] % heads:
        raise ValueError(f"expected [rows, (heads + 2 kv heads) * head_dim], got {tuple(joint.shape)}")
    head_dim = joint.shape[1] // heads
    if head_dim % 2:
        raise ValueError("head_dim must be even for RoPE")
    expected = (num_kv_heads, head_dim)
    if any(t.dim() != 3 or tuple(t.shape[1:]) != expected or t.stride(-1) != 1 for t in (keys_pre, keys, values)):
        raise ValueError(f"keys_pre, keys and values must be [T, {num_kv_heads}, {head_dim}] with a contiguous last axis")
    if not (keys_pre.stride() == keys.stride() == values.stride()):
        raise ValueError("keys_pre, keys and values must share their strides")
    if joint.stride(1) != 1:
        joint = joint.contiguous()
    check_device(joint, keys_pre, keys, values)
    num_rows, half = joint.shape[0], head_dim // 2
    q = torch.empty(num_rows, num_heads, head_dim, dtype=joint.dtype, device=joint.device)
    if num_rows == 0:
        return q
    rows = rows.to(device=joint.device, dtype=torch.int64).contiguous()
    inv_freq = inv_freq.to(device=joint.device, dtype=torch.float32).contiguous()
    if inv_freq.numel() != half:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries, expected head_dim/2 = {half}")
    block_t = 16 if joint.dtype == torch.float32 and half > 32 else 32
    rope_store_kernel[(triton.cdiv(num_rows, block_t),)](
        joint, q, keys_pre, keys, values, rows, inv_freq, num_rows, num_rows, joint.stride(0), q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_T=block_t,
    )
    return q
