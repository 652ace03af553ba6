"""Selective attention by global position: the torch reference.

Queries are any subset of tokens (recomputed chunk tokens, question tokens) at arbitrary global
positions; keys/values are the whole assembled KV. A query sees a key iff key_pos <= query_pos
(and, with a sliding window, key_pos > query_pos - window). PyTorch's `is_causal=True` is
top-left aligned when query and key lengths differ, which is wrong for a token subset, so the
mask is explicit unless the queries are exactly all keys in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor:
    mask = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > (query_pos[:, None] - sliding_window)
    return mask


def selective_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    sliding_window: int | None = None,
    dense_causal: bool = False,
) -> torch.Tensor:
    """q [Tq, H, D], k/v [Tk, Hkv, D] (RoPE applied) -> [Tq, H, D].

    `dense_causal=True` promises queries == keys with positions 0..T-1 in order, which allows the
    fused causal SDPA kernel. GQA: H must be a multiple of Hkv.
    """
    # A leading batch axis matters: on CPU, 3-D inputs fall back to a much slower SDPA path.
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = q.shape[1] != k.shape[1]
    if dense_causal and sliding_window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        mask = position_mask(query_pos, key_pos, sliding_window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)
