"""Triton batched decode: every running sequence's new token in two launches per layer.

A decode step appends one row per sequence to that sequence's own KV buffer and attends its one
new query over that buffer. Done sequence by sequence, that is three row copies and several
attention launches per sequence and layer: thousands of launches per step on a deep model, each
costing more host time than its GPU work. Here a small int64 table, built once per step, holds
each sequence's buffer addresses, layer stride, new row and first visible row; one kernel writes
every sequence's new rows and one attends every sequence's query over its own rows. The buffers
stay where they are (no paging, no copy into a pool): the table addresses them in place.

Attention is flash-decoding: a program owns one sequence and one KV head (its GQA group of query
heads as the rows of one tile) and, when sequences x KV heads would leave most multiprocessors
idle, one slice of the keys; the selective-attention merge kernel then combines the slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ragcache_kernels._triton_common import check_device, dot_in_fp32, interpreting
from ragcache_kernels.triton_attention import (
    LOG2E,
    MAX_SPLITS,
    MERGE_BLOCK_SPLITS,
    key_splits,
    merge_splits_kernel,
    multiprocessors,
)


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step's view of the running sequences' KV buffers, built once per step."""

    # int64 [6, B] on the buffers' device; rows: keys_pre, keys and values addresses, layer
    # stride (elements), the new row's position, the first visible row
    table: torch.Tensor
    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    longest: int  # most visible keys of any sequence (host int: sizes the key split)
    # key slices per sequence and KV head; None: chosen from `longest` at each launch. A CUDA
    # graph fixes it, since a replay cannot change a launch's grid
    splits: int | None = None

    def append(self, layer: int, keys_pre: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        append_rows(self, layer, keys_pre, keys, values)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return decode_attention(self, layer, q, splits=self.splits)

    def write_and_attend(self, layer: int, q: torch.Tensor, keys_pre: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor) -> torch.Tensor:
        """The new rows written, then every sequence's query attended: two launches."""
        self.append(layer, keys_pre, keys, values)
        return self.attend(layer, q)


def decode_batch_table(
    keys_pre: list[torch.Tensor],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    positions: list[int],
    sliding_window: int | None = None,
) -> DecodeBatch:
    """Sequence b writes its new row at `positions[b]` of keys_pre[b]/keys[b]/values[b] (each
    [layers, capacity, kv_heads, head_dim], contiguous, capacity > position) and attends rows
    [start, position] (start = 0, or the window's first row)."""
    columns, longest = table_columns(keys_pre, keys, values, positions, sliding_window)
    host = torch.tensor(columns, dtype=torch.int64).T.contiguous()
    first = keys[0]
    if first.device.type == "cuda":
        host = host.pin_memory()
    table = host.to(first.device, non_blocking=True)
    _, _, kv_heads, head_dim = first.shape
    return DecodeBatch(table, len(keys), kv_heads, head_dim, first.dtype, first.device, longest)


TABLE_ROWS = 6  # keys_pre, keys and values addresses, layer stride, the new row, the first visible row


def table_columns(
    keys_pre: list[torch.Tensor],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    positions: list[int],
    sliding_window: int | None = None,
) -> tuple[list[tuple[int, ...]], int]:
    """Each sequence's TABLE_ROWS values (its column of the table), after checking its buffers,
    and the most keys any sequence sees."""
    if not keys or not (len(keys_pre) == len(keys) == len(values) == len(positions)):
        raise ValueError("one keys_pre, keys, values buffer and position per sequence")
    first = keys[0]
    if first.dim() != 4:
        raise ValueError("KV buffers must be [layers, capacity, kv_heads, head_dim]")
    columns = []
    longest = 0
    for kp, k, v, pos in zip(keys_pre, keys, values, positions, strict=True):
        for t in (kp, k, v):
            if t.shape[0] != first.shape[0] or t.shape[2:] != first.shape[2:] or t.shape[1] != k.shape[1]:
                raise ValueError("every KV buffer needs the same layers, kv_heads and head_dim")
            if t.dtype != first.dtype or t.device != first.device or not t.is_contiguous():
                raise ValueError("KV buffers must be contiguous and share a dtype and device")
        if not 0 <= pos < k.shape[1]:
            raise ValueError(f"position {pos} outside a buffer of capacity {k.shape[1]}")
        start = 0 if sliding_window is None else max(0, pos + 1 - sliding_window)
        longest = max(longest, pos + 1 - start)
        columns.append((kp.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), pos, start))
    return columns, longest


@triton.jit(do_not_specialize=["batch", "layer"])
def _append_rows_kernel(
    TABLE, K_PRE_NEW, K_NEW, V_NEW, batch, layer, stride_new, ROW: tl.constexpr, BLOCK: tl.constexpr
):
    """Sequence b's new pre-RoPE key, rotated key and value, each ROW = kv_heads * head_dim wide,
    into row `position` of `layer` of its three buffers."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    row = layer * tl.load(TABLE + 3 * batch + b) + tl.load(TABLE + 4 * batch + b) * ROW
    src = b.to(tl.int64) * stride_new + offs
    dtype = K_NEW.dtype.element_ty
    k_pre = tl.load(TABLE + b).to(tl.pointer_type(dtype))
    k_rot = tl.load(TABLE + batch + b).to(tl.pointer_type(dtype))
    value = tl.load(TABLE + 2 * batch + b).to(tl.pointer_type(dtype))
    tl.store(k_pre + row + offs, tl.load(K_PRE_NEW + src, mask=ok), mask=ok)
    tl.store(k_rot + row + offs, tl.load(K_NEW + src, mask=ok), mask=ok)
    tl.store(value + row + offs, tl.load(V_NEW + src, mask=ok), mask=ok)


@triton.jit
def online_softmax_tile(q, k, v, n_ok, acc, m_i, l_i, qk_scale, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """One key/value tile folded into a running softmax (exp2 domain, fp32 statistics): the
    group's queries `q` [G, D] against `k`, `v` [N, D], rows where `n_ok` is false ignored.
    Returns the updated (acc, max, normaliser)."""
    if DOT_FP32:
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    scores = tl.where(n_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit(do_not_specialize=["batch", "layer", "num_splits", "stride_ps", "stride_ms"])
def _decode_attention_kernel(
    TABLE, Q, OUT, PART_ACC, PART_ML, batch, layer, num_splits, qk_scale, stride_qb, stride_ob, stride_ps,
    stride_pb, stride_ms, stride_mb, GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr
):
    """Sequence b, KV head h, key slice s: the GQA group's queries over rows [start, position]
    of b's buffers in one online softmax (exp2 domain, fp32 statistics)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    dtype = Q.dtype.element_ty
    keys = tl.load(TABLE + batch + b).to(tl.pointer_type(dtype))
    values = tl.load(TABLE + 2 * batch + b).to(tl.pointer_type(dtype))
    layer_base = layer * tl.load(TABLE + 3 * batch + b)
    end = tl.load(TABLE + 4 * batch + b) + 1
    start = tl.load(TABLE + 5 * batch + b)
    per_split = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, end)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        rows = first + offs_n
        n_ok = rows < hi
        at = (
            layer_base
            + rows.to(tl.int64)[:, None] * (KV_HEADS * HEAD_DIM)
            + kv_head * HEAD_DIM
            + offs_d[None, :]
        )
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(keys + at, mask=kv_mask, other=0.0)
        v = tl.load(values + at, mask=kv_mask, other=0.0)
        acc, m_i, l_i = online_softmax_tile(q, k, v, n_ok, acc, m_i, l_i, qk_scale, DOT_FP32, PRECISION)
    store_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = split.to(tl.int64) * stride_ps + b.to(tl.int64) * stride_pb
        tl.store(PART_ACC + part + heads[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)
        ml = split.to(tl.int64) * stride_ms + b.to(tl.int64) * stride_mb + heads * 2
        tl.store(PART_ML + ml, m_i, mask=g_ok)
        tl.store(PART_ML + ml + 1, l_i, mask=g_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            OUT + b.to(tl.int64) * stride_ob + heads[:, None] * HEAD_DIM + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=store_mask,
        )


def append_rows(
    step: DecodeBatch, layer: int, keys_pre: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Write each sequence's new rows (each [B, kv_heads, head_dim]) into its buffers at `layer`."""
    row = step.kv_heads * step.head_dim
    new = [t.reshape(step.batch, row) for t in (keys_pre, keys, values)]
    new = [t if t.stride(1) == 1 and t.stride(0) == new[0].stride(0) else t.contiguous() for t in new]
    if len({t.stride(0) for t in new}) != 1:
        new = [t.contiguous() for t in new]
    for t in new:
        if t.dtype != step.dtype:
            raise ValueError(f"new rows are {t.dtype}, the buffers {step.dtype}")
    check_device(*new)
    _append_rows_kernel[(step.batch,)](
        step.table,
        new[0],
        new[1],
        new[2],
        step.batch,
        layer,
        new[0].stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


def default_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per tile: the most that compile for sm_90 without spilling registers (fp32 tiles,
    on FMA units with every operand in registers, spill at 64)."""
    if interpreting():
        return 16
    return 32 if dtype == torch.float32 else 64


def decode_attention(
    step: DecodeBatch,
    layer: int,
    q: torch.Tensor,
    scale: float | None = None,
    splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [B, H, D], each sequence's one new query, over its visible rows of `layer` -> [B, H * D].
    `splits` divides each sequence's keys among that many programs (None: chosen from the
    launch's size and the device's multiprocessors)."""
    batch, heads, head_dim = q.shape
    if batch != step.batch or head_dim != step.head_dim or heads % step.kv_heads:
        raise ValueError(
            f"queries {tuple(q.shape)} do not fit {step.batch} sequences of "
            f"{step.kv_heads} KV heads x {step.head_dim}"
        )
    if q.dtype != step.dtype:
        raise ValueError(f"queries are {q.dtype}, the buffers {step.dtype}")
    q = q if q.is_contiguous() else q.contiguous()
    check_device(q)
    group = heads // step.kv_heads
    block_n = block_n or default_block_n(head_dim, q.dtype)
    if splits is None:
        splits = key_splits(batch * step.kv_heads, step.longest, block_n, multiprocessors(q.device))
    splits = max(1, min(splits, triton.cdiv(step.longest, block_n), MAX_SPLITS))
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_acc = torch.empty(splits, batch, heads, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, batch, heads, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    scale = head_dim**-0.5 if scale is None else scale
    _decode_attention_kernel[(batch, step.kv_heads, splits)](
        step.table,
        q,
        out,
        part_acc,
        part_ml,
        batch,
        layer,
        splits,
        scale * LOG2E,
        q.stride(0),
        out.stride(0),
        part_acc.stride(0),
        part_acc.stride(1),
        part_ml.stride(0),
        part_ml.stride(1),
        GROUP=group,
        KV_HEADS=step.kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        DOT_FP32=dot_in_fp32(q.dtype),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        merge_splits_kernel[(batch, heads)](
            part_acc,
            part_ml,
            out,
            splits,
            part_acc.stride(0),
            part_acc.stride(1),
            part_ml.stride(0),
            part_ml.stride(1),
            out.stride(0),
            out.stride(1),
            HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_SPLITS=MERGE_BLOCK_SPLITS,
        )
    return out.reshape(batch, heads * head_dim)
