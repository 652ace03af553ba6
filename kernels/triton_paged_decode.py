"""Triton paged decode attention: every sequence's one new query over its rows of a block pool.

The KV of one layer is a pool of fixed-size blocks ([num_blocks, block_size, kv_heads, head_dim]);
a sequence's block table lists its blocks in row order (`paged_decode` has the torch reference
and the layout). Decode attention is memory-bound: each key and value row is read once and used
for a handful of multiply-adds per query head. So a program owns one sequence and one KV head,
and its GQA group of query heads are the rows of one tile: every key/value tile is read once for
the whole group rather than once per query head.

A tile's rows are looked up one by one in the block table (row // block_size, row % block_size),
so a tile may span several blocks or part of one, and the tile size is chosen for the chip, not
tied to the pool's block size. Rows past a sequence's length, before its window, and the table's
padding are masked: no load reads them.

Flash-decoding: when sequences x KV heads would leave most multiprocessors idle, each sequence's
rows are sliced among several programs, each keeping its own online softmax (fp32 statistics,
exp2 domain), and the selective-attention merge kernel combines the slices; with one slice the
kernel normalises and writes the output itself (one launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ragcache_kernels._triton_common import check_device, dot_in_fp32
from ragcache_kernels.triton_attention import (
    LOG2E,
    MAX_SPLITS,
    MERGE_BLOCK_SPLITS,
    key_splits,
    merge_splits_kernel,
    multiprocessors,
)
from ragcache_kernels.triton_decode import default_block_n, online_softmax_tile

# No window: a sequence's first visible row is max(length - NO_WINDOW, 0) = 0 for any int32
# length, so windowed and unwindowed launches share one compiled kernel.
NO_WINDOW = 2**31 - 1


@triton.jit
def _attend_tiles(q, table, K_BLOCKS, V_BLOCKS, lo, hi, kv_head, qk_scale, stride_kb, stride_kr,
                  stride_kh, stride_vb, stride_vr, stride_vh, offs_d, d_ok, BLOCK_SIZE: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                  PRECISION: tl.constexpr):
    """(acc [BLOCK_G, BLOCK_D], max, normaliser) of the group's queries over rows [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        rows = first + offs_n
        n_ok = rows < hi
        # masked rows take block 0 and are never loaded: table padding is never dereferenced
        block = tl.load(table + rows // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offset = rows % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_at = block * stride_kb + offset * stride_kr + kv_head * stride_kh
        v_at = block * stride_vb + offset * stride_vr + kv_head * stride_vh
        k = tl.load(K_BLOCKS + k_at[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_BLOCKS + v_at[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = online_softmax_tile(q, k, v, n_ok, acc, m_i, l_i, qk_scale, DOT_FP32, PRECISION)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_splits", "window", "stride_ps", "stride_ms"])
def _paged_decode_kernel(
    Q, K_BLOCKS, V_BLOCKS, TABLES, LENGTHS, OUT, PART_ACC, PART_ML, num_splits, window, qk_scale,
    stride_qb, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_tb, stride_ob,
    stride_ps, stride_pb, stride_ms, stride_mb, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr
):
    """Sequence b, KV head h, key slice s: the GQA group's queries over b's visible rows of the
    slice, as a partial softmax (SPLIT) or the normalised output."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    end = tl.load(LENGTHS + b)
    start = tl.maximum(end - window, 0)
    # whole tiles per slice; slices past a short sequence's rows are empty (merged with weight 0)
    per_split = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, end)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    store_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=store_mask,
                other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    table = TABLES + b.to(tl.int64) * stride_tb
    acc, m_i, l_i = _attend_tiles(q, table, K_BLOCKS, V_BLOCKS, lo, hi, kv_head, qk_scale, stride_kb,
                                  stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, offs_d, d_ok,
                                  BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, DOT_FP32, PRECISION)
    if SPLIT:
        part = split.to(tl.int64) * stride_ps + b.to(tl.int64) * stride_pb
        tl.store(PART_ACC + part + heads[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)
        ml = split.to(tl.int64) * stride_ms + b.to(tl.int64) * stride_mb + heads * 2
        tl.store(PART_ML + ml, m_i, mask=g_ok)
        tl.store(PART_ML + ml + 1, l_i, mask=g_ok)
    else:
        # a sequence with no visible row has l = 0 and acc = 0: zeros, not 0 / 0
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(OUT + b.to(tl.int64) * stride_ob + heads[:, None] * HEAD_DIM + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=store_mask)


def _checked(q: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
             block_tables: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, block_tables, lengths) in the layout the kernel reads, after checking the shapes."""
    if q.dim() != 3 or key_blocks.dim() != 4 or value_blocks.shape != key_blocks.shape:
        raise ValueError("expected q [B, Hq, D] and key/value blocks [num_blocks, block_size, Hkv, D]")
    batch, heads, head_dim = q.shape
    if key_blocks.shape[3] != head_dim or heads % key_blocks.shape[2]:
        raise ValueError(f"queries {tuple(q.shape)} do not fit KV blocks {tuple(key_blocks.shape)}")
    if q.dtype != key_blocks.dtype or value_blocks.dtype != key_blocks.dtype:
        raise ValueError(f"queries are {q.dtype}, the blocks {key_blocks.dtype} and {value_blocks.dtype}")
    if key_blocks.stride(3) != 1 or value_blocks.stride(3) != 1:
        raise ValueError("key/value blocks need a unit stride along head_dim")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"need a block table row and a length per sequence ({batch})")
    q = q if q.is_contiguous() else q.contiguous()
    tables = block_tables.to(torch.int32)
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    check_device(q, key_blocks, value_blocks, tables)
    return q, tables, lengths.to(torch.int32).contiguous()


def _splits(wish: int | None, programs: int, longest: int, block_n: int, device: torch.device) -> int:
    """Key slices per sequence: the wish, else enough to fill the multiprocessors; never more than
    the longest sequence has tiles, nor than the merge's tile holds."""
    if wish is None:
        wish = key_splits(programs, longest, block_n, multiprocessors(device))
    return max(1, min(wish, triton.cdiv(max(longest, 1), block_n), MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] over each sequence's rows [max(0, length - window), length) of the pool
    through block_tables [B, max_blocks] (int32; padding never read) and lengths [B] (each at most
    max_blocks * block_size) -> [B, Hq, D] in q's dtype; `paged_decode.paged_decode_attention_reference`
    is the same function. `splits` forces that many key slices per sequence (None: chosen from the
    launch's size, with the table's width as the longest length, so choosing costs no device sync)."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window covers at least one row, got {window}")
    q, tables, lengths = _checked(q, key_blocks, value_blocks, block_tables, lengths)
    batch, heads, head_dim = q.shape
    block_size, kv_heads = key_blocks.shape[1], key_blocks.shape[2]
    block_n = block_n or default_block_n(head_dim, q.dtype)
    longest = tables.shape[1] * block_size if window is None else min(window, tables.shape[1] * block_size)
    splits = _splits(splits, batch * kv_heads, longest, block_n, q.device)
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    part_acc, part_ml = _partials(splits, q)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_decode_kernel[(batch, kv_heads, splits)](
        q, key_blocks, value_blocks, tables, lengths, out, part_acc, part_ml, splits,
        NO_WINDOW if window is None else window, scale * LOG2E, q.stride(0), *key_blocks.stride()[:3],
        *value_blocks.stride()[:3], tables.stride(0), out.stride(0), part_acc.stride(0), part_acc.stride(1),
        part_ml.stride(0), part_ml.stride(1),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(heads // kv_heads)), BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT=splits > 1, DOT_FP32=dot_in_fp32(q.dtype),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        merge_splits_kernel[(batch, heads)](
            part_acc, part_ml, out, splits, part_acc.stride(0), part_acc.stride(1), part_ml.stride(0),
            part_ml.stride(1), out.stride(0), out.stride(1),
            HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SPLITS=MERGE_BLOCK_SPLITS,
        )
    return out


def _partials(splits: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slice's unnormalised output and (max, normaliser) per sequence and query head; a
    one-element placeholder the kernel never touches when the keys are not sliced."""
    if splits == 1:
        placeholder = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
        return placeholder, placeholder
    batch, heads, head_dim = q.shape
    return (torch.empty(splits, batch, heads, head_dim, dtype=torch.float32, device=q.device),
            torch.empty(splits, batch, heads, 2, dtype=torch.float32, device=q.device))
