"""Selective attention by global position: the torch reference.

Queries are any subset of tokens (recomputed chunk tokens, question tokens) at arbitrary global
positions; keys/values are the whole assembled KV. A query sees a key iff key_pos <= query_pos
(and, with a sliding window, key_pos > query_pos - window). PyTorch's `is_causal=True` is
top-left aligned when query and key lengths differ, which is wrong for a token subset, so the
mask is explicit unless the queries are exactly all keys in order.

A decode step's single newest query sees every key, so it needs no mask at all
(`single_query_attention`).
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
    elif sliding_window is None and is_long_suffix(query_pos, key_pos):
        # Queries are the last Tq of Tk consecutive keys (everything after a reused exact prefix).
        # An explicit mask costs Tq*Tk; the causal kernel skips the upper triangle (Tk*Tk/2), so
        # when Tq > Tk/2 it is cheaper to pad the queries to all Tk positions and drop the padding.
        pad = k.shape[0] - q.shape[0]
        padded = torch.cat([qh.new_zeros(1, qh.shape[1], pad, qh.shape[3]), qh], dim=2)
        out = F.scaled_dot_product_attention(padded, kh, vh, is_causal=True, enable_gqa=gqa)[:, :, pad:]
    elif sliding_window is None and (groups := causal_groups(query_pos, key_pos)) is not None:
        # Queries in position order over keys 0..Tk-1: each group of queries reads only the keys
        # up to its last position (a query never sees a later key), so the masked product over
        # keys no query of the group can see is skipped, as the causal kernel skips the upper
        # triangle. Same result as one masked call; with queries spread over the prompt the work
        # is about half.
        out = qh.new_empty(qh.shape)
        for start, end in groups:
            last = int(query_pos[end - 1]) + 1
            mask = position_mask(query_pos[start:end], key_pos[:last])
            out[:, :, start:end] = F.scaled_dot_product_attention(
                qh[:, :, start:end], kh[:, :, :last], vh[:, :, :last], attn_mask=mask, enable_gqa=gqa)
    else:
        mask = position_mask(query_pos, key_pos, sliding_window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)


# Queries per group: below this the per-call overhead outweighs the keys a split skips.
MIN_GROUP_QUERIES = 64
MAX_GROUPS = 16


def causal_groups(query_pos: torch.Tensor, key_pos: torch.Tensor) -> list[tuple[int, int]] | None:
    """Equal-size runs [start, end) of the queries when they are sorted by position and the keys
    are positions 0..Tk-1 in order (the fused prefill's layout); None where a split cannot pay
    (too few queries, or the queries all sit at the end where every group reads nearly all keys)."""
    tq, tk = query_pos.shape[0], key_pos.shape[0]
    count = min(MAX_GROUPS, tq // MIN_GROUP_QUERIES)
    if count < 2 or int(query_pos[0]) >= tk // 2:
        return None
    if not bool((query_pos[1:] > query_pos[:-1]).all()):
        return None
    if int(key_pos[0]) != 0 or int(key_pos[-1]) != tk - 1 or not torch.equal(
            key_pos, torch.arange(tk, device=key_pos.device, dtype=key_pos.dtype)):
        return None
    bounds = [round(i * tq / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def is_long_suffix(query_pos: torch.Tensor, key_pos: torch.Tensor) -> bool:
    tq, tk = query_pos.shape[0], key_pos.shape[0]
    if not (tk // 2 < tq < tk):
        return False
    expected = torch.arange(tk, device=key_pos.device, dtype=key_pos.dtype)
    return bool(torch.equal(key_pos, expected) and torch.equal(query_pos, expected[tk - tq:]))


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """The newest token's query [H, D] over keys [n, Hkv, D] -> [H * D]. It sees every key (the
    last `window` with a sliding window), so no mask is needed. Two small matmuls; the softmax in
    fp32: CPU SDPA's flash kernel costs several times as much for a single query. In fp32 the
    query goes left (q @ K^T). In bf16/fp16 the keys go left (K @ q^T) in their own dtype, because
    converting K and V to fp32 would be a large share of a batched decode step; the scores are
    rounded to bf16 once, as in transformers' eager attention. The same order in fp32 is slower,
    hence two paths."""
    if window is not None and k.shape[0] > window:
        k, v = k[-window:], v[-window:]
    kv_heads, head_dim = k.shape[1], k.shape[2]
    scale = head_dim**-0.5
    queries = q.view(kv_heads, q.shape[0] // kv_heads, head_dim)
    if q.dtype == torch.float32:
        scores = torch.matmul(queries, k.permute(1, 2, 0)).mul_(scale)
        return torch.matmul(torch.softmax(scores, dim=-1), v.permute(1, 0, 2)).reshape(-1)
    scores = torch.matmul(k.transpose(0, 1), queries.transpose(1, 2))  # [Hkv, n, group]
    probs = torch.softmax(scores.float().mul_(scale), dim=1).to(v.dtype)
    return torch.matmul(probs.transpose(1, 2), v.transpose(0, 1)).reshape(-1)  # [Hkv, group, D]

def segment_ids_from_boundaries(boundaries: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Segment id per key from sorted segment start offsets (into the key axis).

    boundaries[s] is the first key of segment s; keys before boundaries[0] get -1 (not counted in
    any segment's mass, e.g. a system prefix one does not care about).
    """
    keys = torch.arange(num_keys, device=boundaries.device)
    return torch.searchsorted(boundaries.to(torch.int64), keys, right=True) - 1


def selective_attention_with_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    segment_ids: torch.Tensor,
    num_segments: int,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for attention plus per-segment attention mass.

    Returns (out [Tq, H, D] in q's dtype, mass [Tq, num_segments] fp32) where mass[i, s] is the
    softmax probability query i puts on keys of segment s, averaged over query heads. Keys whose
    segment id is outside [0, num_segments) count in the softmax but in no segment. Scores are
    materialised in fp32, so this is for checking and for CPU-sized inputs, not for speed.
    """
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    group = heads // kv_heads
    qf = q.float().transpose(0, 1)  # [H, Tq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    visible = position_mask(query_pos, key_pos, sliding_window)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)
    counted = (segment_ids >= 0) & (segment_ids < num_segments)
    per_key = probs.mean(0)[:, counted]  # [Tq, counted keys]
    mass = torch.zeros(q.shape[0], num_segments, dtype=torch.float32, device=q.device)
    mass.index_add_(1, segment_ids[counted].to(torch.int64), per_key)
    return out, mass
