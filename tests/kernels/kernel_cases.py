"""Shared inputs and float64 ground truth for the kernel tests."""

from __future__ import annotations

import torch

# (atol, rtol) for Triton kernel vs torch reference on attention/RoPE outputs, per input dtype.
# fp32: both sides compute in fp32, differences are summation order (~1e-7 seen).
# fp16/bf16: both round the fp32 result to the dtype; rounding of intermediates (the reference's
# fp16 RoPE products, the kernel's fp16 P tile before P@V) adds about one ulp more. bf16's ulp at
# 1.0 is 2**-7 ~ 0.0078 and outputs reach ~3, hence 2-3 ulps at that magnitude.
TOL = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
# Attention mass is accumulated in fp32 on both sides from identical fp32 scores.
MASS_TOL = (2e-5, 1e-4)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook softmax(Q K^T / sqrt(d)) V with the position mask, in float64.

    Written independently of the code under test (explicit loop over heads, GQA by integer
    division of the head index) so the reference itself can be checked against it. Returns
    (out [Tq, H, D], probs [H, Tq, Tk]).
    """
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    visible = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
    outs, probs = [], []
    for h in range(heads):
        kvh = h // (heads // kv_heads)
        scores = q[:, h].double() @ k[:, kvh].double().T / dim**0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        probs.append(p)
        outs.append(p @ v[:, kvh].double())
    return torch.stack(outs, dim=1), torch.stack(probs)


def scattered_case(
    num_queries: int,
    num_keys: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    seed: int,
    gapped_keys: bool = True,
    shuffled_keys: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Keys at positions with gaps (optionally stored out of position order) and queries at a
    random, unsorted subset of the key positions (so every query sees at least itself)."""
    gen = torch.Generator().manual_seed(seed)
    if gapped_keys:
        key_pos = torch.randperm(3 * num_keys, generator=gen)[:num_keys].sort().values + 100
    else:
        key_pos = torch.arange(num_keys)
    if shuffled_keys:
        key_pos = key_pos[torch.randperm(num_keys, generator=gen)]
    query_pos = key_pos[torch.randperm(num_keys, generator=gen)[:num_queries]]
    q = torch.randn(num_queries, heads, dim, generator=gen).to(dtype)
    k = torch.randn(num_keys, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_keys, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, query_pos, key_pos
