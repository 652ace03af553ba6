"""The torch references themselves, against float64 textbook maths (no triton needed)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import dense_attention, scattered_case

from ragcache_kernels.attention import (
    segment_ids_from_boundaries,
    selective_attention,
    selective_attention_with_mass,
)
from ragcache_kernels.kv import kv_deviation, scatter_rows, topk_tokens
from ragcache_kernels.rope import inv_frequencies, rotate_keys, span_positions


@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("shuffled", [False, True])
def test_reference_attention_matches_dense(gqa: int, window: int | None, shuffled: bool) -> None:
    kv_heads = 1 if gqa == 8 else 2
    q, k, v, qpos, kpos = scattered_case(
        13, 31, gqa * kv_heads, kv_heads, 64, torch.float32, seed=gqa, shuffled_keys=shuffled
    )
    expected, probs = dense_attention(q, k, v, qpos, kpos, window)
    got = selective_attention(q, k, v, qpos, kpos, sliding_window=window)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)

    seg = segment_ids_from_boundaries(torch.tensor([4, 11, 20]), 31)
    out, mass = selective_attention_with_mass(q, k, v, qpos, kpos, seg, 3, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    head_avg = probs.mean(0)  # [Tq, Tk]
    for s in range(3):
        torch.testing.assert_close(mass[:, s].double(), head_avg[:, seg == s].sum(-1), atol=1e-6, rtol=1e-5)


def test_reference_dense_causal_path_matches_dense() -> None:
    q, k, v, _, _ = scattered_case(19, 19, 6, 2, 64, torch.float32, seed=3)
    pos = torch.arange(19)
    expected, _ = dense_attention(q, k, v, pos, pos)
    got = selective_attention(q, k, v, pos, pos, dense_causal=True)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_mass_sums_to_counted_share() -> None:
    q, k, v, qpos, kpos = scattered_case(9, 25, 4, 2, 64, torch.float32, seed=5, gapped_keys=False)
    # Every key in some segment: mass of each query sums to 1.
    seg_all = segment_ids_from_boundaries(torch.tensor([0, 7, 15]), 25)
    _, mass = selective_attention_with_mass(q, k, v, qpos, kpos, seg_all, 3)
    torch.testing.assert_close(mass.sum(-1), torch.ones(9), atol=1e-6, rtol=0)
    # Keys before the first boundary belong to no segment and are left out.
    seg = segment_ids_from_boundaries(torch.tensor([7, 15]), 25)
    assert seg[:7].eq(-1).all()
    _, partial = selective_attention_with_mass(q, k, v, qpos, kpos, seg, 2)
    torch.testing.assert_close(partial, mass[:, 1:], atol=1e-6, rtol=0)


def _rope_float64(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """RoPE as complex multiplication, pair i = (i, i + D/2) (NeoX) or (2i, 2i + 1) (interleaved)."""
    half = x.shape[-1] // 2
    xd = x.double()
    if interleaved:
        re, im = xd[..., 0::2], xd[..., 1::2]
    else:
        re, im = xd[..., :half], xd[..., half:]
    angle = positions.double()[:, None, None] * inv_freq.double()[None, None, :]
    rotated = torch.complex(re, im) * torch.polar(torch.ones_like(angle), angle)
    out = torch.empty_like(xd)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = rotated.real, rotated.imag
    else:
        out[..., :half], out[..., half:] = rotated.real, rotated.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_reference_rope_is_a_rotation(interleaved: bool, rope_type: str) -> None:
    inv = inv_frequencies(64, 1e5, rope_type=rope_type, factor=8.0, original_max_position_embeddings=256)
    x = torch.randn(23, 3, 64)
    positions = torch.randint(0, 3000, (23,))
    got = rotate_keys(x, positions, inv, interleaved)
    # fp32 angles of positions ~3000 carry ~2e-4 rad of rounding; the reference rounds them too.
    torch.testing.assert_close(got.double(), _rope_float64(x, positions, inv, interleaved), atol=2e-3, rtol=0)
    # Rotations keep norms.
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)


def test_span_positions() -> None:
    got = span_positions(torch.tensor([10, 0, 50]), torch.tensor([3, 2, 4]))
    assert got.tolist() == [10, 11, 12, 0, 1, 50, 51, 52, 53]
    assert span_positions(torch.tensor([5]), torch.tensor([0])).numel() == 0


def test_reference_deviation_topk_and_scatter() -> None:
    new = torch.randn(6, 2, 8)
    cached = new.clone()
    cached[1, 0, 3] += 3.0
    cached[4, 1] += 1.0  # norm sqrt(8)
    dev = kv_deviation(new, cached)
    torch.testing.assert_close(dev, torch.tensor([0.0, 3.0, 0.0, 0.0, math.sqrt(8), 0.0]), atol=1e-5, rtol=0)
    assert topk_tokens(dev, 2).tolist() == [1, 4]
    assert topk_tokens(dev, 0).numel() == 0
    big = torch.randn(10, 2, 8)
    idx = torch.tensor([7, 2, 9, 0, 5, 1])
    torch.testing.assert_close(kv_deviation(new, big, idx), kv_deviation(new, big[idx]))
    dst = torch.zeros(10, 2, 8)
    scatter_rows(dst, idx, new)
    assert torch.equal(dst[idx], new)
