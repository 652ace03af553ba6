"""Triton launches of a fused prefill's sparse layers that read their buffers from a device table.

A sparse layer (the rows a policy kept recomputing, over every key of the prompt) launches the
same kernels as the executor's op-by-op path: one that rotates q and k and stores k and v into
the request's KV buffer, and selective attention over the buffer's first `num_keys` rows. Here
both take the buffer's addresses, its layer stride, the key count and the row count from a
small int64 table on the device instead of from their arguments. Their grids depend only on a
fixed row bucket and a fixed key split, so a CUDA graph captured once serves every request whose
rows fit the bucket: before each replay one copy rewrites the table and the rows.

Rows past the table's row count (the bucket's padding) are rotated and attended, so the
activations stay finite, but store nothing: no request's KV is touched by them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ragcache_kernels._triton_common import check_device, dot_in_fp32
from ragcache_kernels.triton_attention import (
    FAR,
    LOG2E,
    MERGE_BLOCK_SPLITS,
    attend_keys_at_index,
    default_blocks,
    merge_splits_kernel,
    store_queries,
)
from ragcache_kernels.triton_rope import rope_store_kernel

# The table: the buffers' addresses, the layer stride (elements), the keys attended, the rows
# stored, and the last stored row's index among the rows (where the logits are read)
KEYS_PRE, KEYS, VALUES, LAYER_STRIDE, NUM_KEYS, NUM_ROWS, LAST_ROW = range(7)
TABLE_SIZE = 7
# the same entries as the kernels see them (a jitted function reads only constexpr globals)
_KEYS_PRE, _KEYS, _VALUES = tl.constexpr(KEYS_PRE), tl.constexpr(KEYS), tl.constexpr(VALUES)
_LAYER_STRIDE, _NUM_KEYS, _NUM_ROWS = tl.constexpr(LAYER_STRIDE), tl.constexpr(NUM_KEYS), tl.constexpr(NUM_ROWS)
BLOCK_S = tl.constexpr(16)  # the mass tile's width, unused here (no mass), but part of the shared helpers' shapes


def addressable(keys_pre: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the table can describe these buffers: [layers, capacity, kv_heads, head_dim] each,
    alike, contiguous, on one device, 16-byte aligned with a layer stride of whole 16-element
    runs (what the kernels tell the compiler, so their loads and stores vectorise)."""
    return (keys.dim() == 4 and keys_pre.shape == keys.shape == values.shape
            and keys_pre.dtype == keys.dtype == values.dtype
            and all(t.is_contiguous() and t.device == keys.device and t.data_ptr() % 16 == 0
                    for t in (keys_pre, keys, values))
            and keys.stride(0) % 16 == 0)


def table_values(keys_pre: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_keys: int,
                 num_rows: int) -> list[int]:
    """The table for a prefill over `num_keys` prompt rows of these buffers ([layers, capacity,
    kv_heads, head_dim] each, contiguous, one layout) recomputing `num_rows` of them."""
    if not addressable(keys_pre, keys, values):
        raise ValueError("KV buffers must be [layers, capacity, kv_heads, head_dim], alike, contiguous, on one "
                         "device, 16-byte aligned, with a layer stride of a multiple of 16")
    if not 0 < num_keys <= keys.shape[1] or not 0 < num_rows <= num_keys:
        raise ValueError(f"{num_rows} rows over {num_keys} keys do not fit a buffer of {keys.shape[1]} rows")
    return [keys_pre.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), num_keys, num_rows, num_rows - 1]


@triton.jit(do_not_specialize=["layer", "num_queries"])
def _store_from_table_kernel(
    TABLE, QKV, Q_OUT, ROWS, INV_FREQ, layer, num_queries, stride_src, stride_qt, stride_qh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr
):
    dtype = QKV.dtype.element_ty
    # the buffers are 16-byte aligned with a layer stride of a multiple of 16 elements (`addressable`):
    # said so, the stores vectorise (unsaid, ptxas took 255 registers and spilled at 8B's heads)
    at_layer = tl.multiple_of(layer * tl.load(TABLE + _LAYER_STRIDE), 16)
    keys_pre = tl.multiple_of(tl.load(TABLE + _KEYS_PRE).to(tl.pointer_type(dtype)), 16) + at_layer
    keys = tl.multiple_of(tl.load(TABLE + _KEYS).to(tl.pointer_type(dtype)), 16) + at_layer
    values = tl.multiple_of(tl.load(TABLE + _VALUES).to(tl.pointer_type(dtype)), 16) + at_layer
    rope_store_kernel(QKV, Q_OUT, keys_pre, keys, values, ROWS, INV_FREQ, num_queries, tl.load(TABLE + _NUM_ROWS),
                      stride_src, stride_qt, stride_qh, NUM_KV_HEADS * HEAD_DIM, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS,
                      HEAD_DIM, HALF, BLOCK_HALF, BLOCK_T)


@triton.jit(do_not_specialize=["layer", "num_queries"])
def _attend_from_table_kernel(
    TABLE, ROWS, Q, OUT, PART_ACC, PART_ML, layer, num_queries, qk_scale, window, stride_qt, stride_qh, stride_ot,
    stride_oh, stride_ps, stride_pt, stride_ms, stride_mtq, GROUP: tl.constexpr, KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr
):
    """Query block m of one head over its slice of the table's keys (key i at position i)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    dtype = Q.dtype.element_ty
    at_layer = tl.multiple_of(layer * tl.load(TABLE + _LAYER_STRIDE), 16)
    keys = tl.multiple_of(tl.load(TABLE + _KEYS).to(tl.pointer_type(dtype)), 16) + at_layer
    values = tl.multiple_of(tl.load(TABLE + _VALUES).to(tl.pointer_type(dtype)), 16) + at_layer
    num_keys = tl.load(TABLE + _NUM_KEYS).to(tl.int32)
    # the split is fixed by the grid; each slice's length follows this request's key count
    keys_per_split = tl.cdiv(tl.cdiv(num_keys, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    key_lo = split * keys_per_split
    key_hi = tl.minimum(key_lo + keys_per_split, num_keys)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < num_queries
    d_ok = offs_d < HEAD_DIM
    qpos = tl.load(ROWS + offs_m, mask=m_ok, other=0)
    q = tl.load(Q + offs_m.to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_hi = tl.max(tl.where(m_ok, qpos, -FAR), axis=0)
    q_lo = tl.min(tl.where(m_ok, qpos, FAR), axis=0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seg_acc = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
    seg_cols = tl.arange(0, BLOCK_S)
    acc, seg_acc, m_i, l_i = attend_keys_at_index(
        acc, seg_acc, m_i, l_i, q, qpos, q_lo, q_hi, keys, values, ROWS, ROWS, key_lo, key_hi, kv_head, qk_scale,
        window, KV_HEADS * HEAD_DIM, HEAD_DIM, KV_HEADS * HEAD_DIM, HEAD_DIM, offs_d, d_ok, seg_cols, BLOCK_N,
        HAS_WINDOW, False, DOT_FP32, PRECISION)
    store_queries(OUT, PART_ACC, PART_ACC, PART_ML, acc, seg_acc, m_i, l_i, offs_m, offs_d, seg_cols, m_ok, d_ok, head,
                  split, stride_ot, stride_oh, 0, 0, stride_ps, stride_pt, stride_ms, stride_mtq, HEAD_DIM, False,
                  SPLIT)


@dataclass(frozen=True)
class PrefillTable:
    """The fixed inputs of a bucket's sparse layers: the table and the rows' positions (ascending,
    the padding repeating the last), both on the device and rewritten before each replay."""

    table: torch.Tensor  # int64 [TABLE_SIZE]
    rows: torch.Tensor  # int64 [bucket]
    num_heads: int
    kv_heads: int
    head_dim: int
    splits: int  # key slices per query block and head, fixed for every request of the bucket
    sliding_window: int | None = None

    @property
    def bucket(self) -> int:
        return self.rows.shape[0]

    def store(self, layer: int, joint: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """q of every row rotated [bucket, H, D]; the stored rows' k (as computed, and rotated)
        and v into layer `layer` of the table's buffers. `joint` is the layer's fused q/k/v
        projection [bucket, (H + 2 Hkv) D] (NeoX RoPE), `inv_freq` fp32 [D / 2]."""
        heads, d = self.num_heads + 2 * self.kv_heads, self.head_dim
        if joint.shape != (self.bucket, heads * d) or joint.stride(1) != 1:
            raise ValueError(f"expected [{self.bucket}, {heads * d}] rows with a contiguous last axis")
        check_device(joint, self.table)
        q = torch.empty(self.bucket, self.num_heads, d, dtype=joint.dtype, device=joint.device)
        block_t = 16 if joint.dtype == torch.float32 and d // 2 > 32 else 32
        _store_from_table_kernel[(triton.cdiv(self.bucket, block_t),)](
            self.table, joint, q, self.rows, inv_freq, layer, self.bucket, joint.stride(0), q.stride(0),
            q.stride(1), NUM_HEADS=self.num_heads, NUM_KV_HEADS=self.kv_heads, HEAD_DIM=d, HALF=d // 2,
            BLOCK_HALF=triton.next_power_of_2(d // 2), BLOCK_T=block_t,
        )
        return q

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Every row's query [bucket, H, D] over layer `layer`'s first NUM_KEYS rotated keys and
        values, causal by position -> [bucket, H, D]."""
        if q.shape != (self.bucket, self.num_heads, self.head_dim) or q.stride(-1) != 1:
            raise ValueError(f"expected q [{self.bucket}, {self.num_heads}, {self.head_dim}]")
        check_device(q, self.table)
        out = torch.empty_like(q)
        block_m, block_n = default_blocks(self.head_dim, q.dtype)
        split = self.splits > 1
        part_acc = torch.empty(self.splits if split else 1, self.bucket if split else 1, self.num_heads,
                               self.head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(self.splits if split else 1, self.bucket if split else 1, self.num_heads, 2,
                              dtype=torch.float32, device=q.device)
        block_d = max(16, triton.next_power_of_2(self.head_dim))
        grid = (triton.cdiv(self.bucket, block_m), self.num_heads, self.splits)
        _attend_from_table_kernel[grid](
            self.table, self.rows, q, out, part_acc, part_ml, layer, self.bucket, self.head_dim**-0.5 * LOG2E,
            int(self.sliding_window or 0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            part_acc.stride(0), part_acc.stride(1), part_ml.stride(0), part_ml.stride(1),
            GROUP=self.num_heads // self.kv_heads, KV_HEADS=self.kv_heads, HEAD_DIM=self.head_dim, BLOCK_D=block_d,
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=self.sliding_window is not None, SPLIT=split,
            DOT_FP32=dot_in_fp32(q.dtype), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            **({"num_stages": 1} if q.dtype == torch.float32 else {}),
        )
        if split:
            merge_splits_kernel[(self.bucket, self.num_heads)](
                part_acc, part_ml, out, self.splits, part_acc.stride(0), part_acc.stride(1), part_ml.stride(0),
                part_ml.stride(1), out.stride(0), out.stride(1), HEADS=self.num_heads, HEAD_DIM=self.head_dim,
                BLOCK_D=block_d, BLOCK_SPLITS=MERGE_BLOCK_SPLITS,
            )
        return out
