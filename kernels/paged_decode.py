"""Decode attention over a paged KV pool: the torch reference.

A paged pool keeps every sequence's keys and values in fixed-size blocks of one shared tensor per
layer ([num_blocks, block_size, kv_heads, head_dim]); a sequence's block table lists its blocks in
order, so its row i lives at block_tables[b, i // block_size], offset i % block_size. Memory is
then taken as a sequence grows instead of reserved for its longest possible length.

Each sequence has one new query (the decode step's token, at position length - 1), which sees
every row of its sequence, or only the last `window` rows with a sliding window. The Triton
kernel (`triton_paged_decode`) computes the same function on a GPU; this version is its
reference and the path on devices without Triton.
"""

from __future__ import annotations

import torch


def row_slots(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
              window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [B, T] int64, visible [B, T] bool) for T = the longest sequence's length: row i of
    sequence b at flat slot block * block_size + i % block_size of the pool viewed as
    [num_blocks * block_size, ...]. Rows a sequence does not have (past its length, before its
    window, or behind table padding) are invisible and point at slot 0, so a gather never reads
    a padded table entry's block id."""
    longest = int(lengths.max()) if lengths.numel() else 0
    rows = torch.arange(longest, device=block_tables.device)
    lengths = lengths.to(device=block_tables.device, dtype=torch.int64)[:, None]
    visible = rows[None, :] < lengths
    if window is not None:
        visible &= rows[None, :] >= lengths - window
    column = (rows // block_size).clamp(max=max(block_tables.shape[1] - 1, 0))
    blocks = block_tables.to(torch.int64).index_select(1, column)
    slots = torch.where(visible, blocks * block_size + rows % block_size, 0)
    return slots, visible


def paged_decode_attention_reference(
    q: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D], one query per sequence, over its rows of key_blocks/value_blocks
    [num_blocks, block_size, Hkv, D] through block_tables [B, max_blocks] (padding never read)
    and lengths [B] -> [B, Hq, D] in q's dtype, computed in fp32. A sequence that sees no row
    (length 0) gets zeros, as from the Triton kernel. GQA: Hq is a multiple of Hkv, query head h
    reading KV head h // (Hq // Hkv)."""
    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = key_blocks.shape
    slots, visible = row_slots(block_tables, lengths, block_size, window)
    flat_k = key_blocks.reshape(num_blocks * block_size, kv_heads, head_dim)
    flat_v = value_blocks.reshape(num_blocks * block_size, kv_heads, head_dim)
    # [B, T, Hkv, D] gathered rows; the reference's memory is the batch's KV, not the pool's
    k = flat_k.index_select(0, slots.reshape(-1)).reshape(batch, -1, kv_heads, head_dim).float()
    v = flat_v.index_select(0, slots.reshape(-1)).reshape(batch, -1, kv_heads, head_dim).float()
    # invisible rows read slot 0, which may never have been written: a NaN there times a zero
    # probability would still be NaN
    v = v.masked_fill(~visible[:, :, None, None], 0.0)
    grouped = q.float().reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", grouped, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    # a row of only -inf softmaxes to NaN: zeros instead, the kernel's answer for "no key"
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return out.reshape(batch, heads, head_dim).to(q.dtype)
