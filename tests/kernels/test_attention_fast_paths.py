"""The torch reference's fast path for queries that are a long suffix of the keys (everything
after a reused exact prefix) must equal the explicit-mask computation it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragcache_kernels.attention import causal_groups, is_long_suffix, position_mask, selective_attention


def masked_reference(q, k, v, query_pos, key_pos):
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=position_mask(query_pos, key_pos),
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("num_keys, prefix, heads, kv_heads", [(37, 5, 4, 4), (50, 24, 8, 1), (301, 1, 9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_suffix_queries_equal_the_masked_computation(num_keys, prefix, heads, kv_heads, dtype):
    torch.manual_seed(num_keys)
    q = torch.randn(num_keys - prefix, heads, 64, dtype=dtype)
    k, v = (torch.randn(num_keys, kv_heads, 64, dtype=dtype) for _ in range(2))
    query_pos, key_pos = torch.arange(prefix, num_keys), torch.arange(num_keys)
    assert is_long_suffix(query_pos, key_pos)
    got = selective_attention(q, k, v, query_pos, key_pos)
    want = masked_reference(q, k, v, query_pos, key_pos)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("query_pos, num_keys", [
    (torch.arange(30, 40), 40),                      # short suffix: the mask is cheaper
    (torch.tensor([1, 2, 3, 5, 6, 7, 8, 9]), 10),   # a gap: not a suffix
    (torch.arange(2, 9), 10),                        # does not end at the last key
])
def test_other_query_sets_keep_the_explicit_mask(query_pos, num_keys):
    assert not is_long_suffix(query_pos, torch.arange(num_keys))


@pytest.mark.parametrize("num_keys, picks, heads, kv_heads", [(300, 150, 4, 4), (700, 260, 9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_spread_over_the_prompt_grouped_by_position_equal_the_masked_computation(
        num_keys, picks, heads, kv_heads, dtype):
    """Recomputed tokens spread over the prompt plus a contiguous tail (the question): each group
    reads only the keys up to its last position, and the result is the one masked call's."""
    torch.manual_seed(picks)
    spread = torch.sort(torch.randperm(num_keys - 40)[:picks]).values
    query_pos = torch.cat([spread, torch.arange(num_keys - 40, num_keys)])
    key_pos = torch.arange(num_keys)
    groups = causal_groups(query_pos, key_pos)
    assert groups is not None and len(groups) >= 2
    assert groups[0][0] == 0 and groups[-1][1] == len(query_pos)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
    q = torch.randn(len(query_pos), heads, 64, dtype=dtype)
    k, v = (torch.randn(num_keys, kv_heads, 64, dtype=dtype) for _ in range(2))
    got = selective_attention(q, k, v, query_pos, key_pos)
    want = masked_reference(q, k, v, query_pos, key_pos)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("query_pos, num_keys", [
    (torch.arange(900, 1000), 1000),                        # every query in the last half
    (torch.tensor([5, 3] + list(range(10, 200))), 400),      # not sorted
    (torch.arange(0, 100), 400),                             # too few for two groups of 64
])
def test_query_sets_a_split_cannot_help_stay_one_call(query_pos, num_keys):
    assert causal_groups(query_pos, torch.arange(num_keys)) is None


def test_keys_not_in_position_order_are_never_split():
    query_pos = torch.arange(0, 400, 2)
    assert causal_groups(query_pos, torch.arange(400).flip(0)) is None
