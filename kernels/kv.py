"""KV deviation (CacheBlend's check layer) and row scatter: torch references.

Deviation is per token: for each head, the L2 norm over head_dim of (recomputed - cached), then
summed over heads, in fp32. Tokens with the largest deviation are the ones whose cached KV is
most wrong in the fused context, so they are the ones worth recomputing in later layers.
"""

from __future__ import annotations

import torch


def kv_deviation(
    new: torch.Tensor,
    cached: torch.Tensor,
    cached_index: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
) -> torch.Tensor:
    """new [T, H, D] vs cached [T, H, D] (or cached[cached_index] when given) -> [T] fp32.

    `accumulate` ([T] fp32) is added to and returned, so K and V deviations can be summed
    without a temporary.
    """
    if cached_index is not None:
        cached = cached.index_select(0, cached_index.to(torch.int64))
    dev = (new.float() - cached.float()).square().sum(-1).sqrt().sum(-1)
    if accumulate is None:
        return dev
    return accumulate.add_(dev)


def topk_tokens(deviation: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest deviations, in ascending token order (so positions stay sorted)."""
    k = max(0, min(int(k), deviation.numel()))
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=deviation.device)
    return torch.topk(deviation, k, sorted=False).indices.sort().values


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index[i]] = src[i] in place (index_copy along dim 0); indices must be unique."""
    n = index.numel()
    if n > 1 and index.device.type == "cpu":
        first, last = int(index[0]), int(index[-1])
        # one ascending run of rows (a full prefill, a fresh suffix): a plain slice copy, which is
        # parallel and vectorised where index_copy_ goes row by row
        if last - first + 1 == n and bool((index[1:] > index[:-1]).all()):
            dst[first : last + 1].copy_(src)
            return dst
    dst.index_copy_(0, index.to(torch.int64), src)
    return dst
