"""CacheBlend's check-layer pick by hand: the top deviations among the fused rows, with the kept
count known on the host (no read-back of the mask on a GPU) and equal to the mask's."""

from __future__ import annotations

import math

import pytest
import torch

from engine_sidecar.execution.fused_prefill import kept_indices
from engine_sidecar.execution.policies import CacheBlendPolicy, KeptRows, LayerView


def _view(must_keep: torch.Tensor, new_v: torch.Tensor, all_v: torch.Tensor, host_count: bool) -> LayerView:
    active = torch.arange(must_keep.shape[0])
    return LayerView(1, active, must_keep, torch.zeros_like(new_v), new_v, torch.zeros_like(all_v), all_v, 4,
                     must_keep_count=int(must_keep.sum()) if host_count else None)


@pytest.mark.parametrize("host_count", [True, False])
def test_the_pick_is_the_top_deviations_and_its_count_is_exact(host_count):
    gen = torch.Generator().manual_seed(0)
    must_keep = torch.zeros(12, dtype=torch.bool)
    must_keep[[0, 5, 11]] = True  # a fresh row and the question's two rows
    new_v = torch.randn(12, 2, 4, generator=gen)
    all_v = torch.randn(12, 2, 4, generator=gen)
    policy = CacheBlendPolicy(0.3)
    fused_total = 9  # what select counted: the nine cached rows
    keep = policy.refine(fused_total, _view(must_keep, new_v, all_v, host_count))
    assert isinstance(keep, KeptRows)
    deviation = (new_v - all_v).pow(2).sum(dim=(1, 2))
    deviation[must_keep] = -1.0
    budget = math.ceil(0.3 * 9)
    expected = must_keep.clone()
    expected[deviation.topk(budget).indices] = True
    assert torch.equal(keep.mask, expected) and keep.count == int(expected.sum()) == 3 + budget
    assert torch.equal(kept_indices(keep, torch.device("cpu")), expected.nonzero().squeeze(1))


def test_a_budget_past_the_candidates_keeps_them_all():
    must_keep = torch.tensor([True, False, False, True])
    policy = CacheBlendPolicy(0.9)
    fused_total = 10  # more than the two rows left to choose from
    keep = policy.refine(fused_total, _view(must_keep, torch.ones(4, 1, 2), torch.zeros(4, 1, 2), host_count=True))
    assert isinstance(keep, KeptRows) and keep.mask.all() and keep.count == 4


@pytest.mark.parametrize(("fused", "min_tokens", "expected_budget"), [(9, 5, 5), (9, 2, 3), (9, 0, 3), (9, 40, 9)])
def test_min_tokens_raises_a_short_prompts_budget_to_the_top_deviations(fused, min_tokens, expected_budget):
    # the budget is max(ceil(r x fused), N), never more than the fused rows there are
    gen = torch.Generator().manual_seed(1)
    must_keep = torch.zeros(fused + 3, dtype=torch.bool)
    must_keep[-3:] = True  # the question's rows
    new_v = torch.randn(fused + 3, 2, 4, generator=gen)
    all_v = torch.randn(fused + 3, 2, 4, generator=gen)
    policy = CacheBlendPolicy(0.3, min_tokens=min_tokens)
    fused_total = fused
    keep = policy.refine(fused_total, _view(must_keep, new_v, all_v, host_count=True))
    assert isinstance(keep, KeptRows)
    deviation = (new_v - all_v).pow(2).sum(dim=(1, 2))
    deviation[must_keep] = -1.0
    expected = must_keep.clone()
    expected[deviation.topk(expected_budget).indices] = True
    assert torch.equal(keep.mask, expected) and keep.count == 3 + expected_budget


def test_min_tokens_sets_the_floor_of_every_gradual_step():
    policy = CacheBlendPolicy(0.125, gradual=True, min_tokens=5)
    fused_total = 16  # 3r, 2r, r = 6, 4, 2 rows: the floor lifts the last two to 5
    must_keep = torch.zeros(16, dtype=torch.bool)
    counts = []
    for layer in (1, 2, 3):
        view = LayerView(layer, torch.arange(16), must_keep, torch.zeros(16, 1, 2), torch.rand(16, 1, 2),
                         torch.zeros(16, 1, 2), torch.zeros(16, 1, 2), 8, must_keep_count=0)
        keep = policy.refine(fused_total, view)
        assert isinstance(keep, KeptRows)
        counts.append(keep.count)
    assert counts == [6, 5, 5]


PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
]


def test_min_tokens_on_a_real_engine_recomputes_the_floor_and_ratio_one_is_full(tiny_engine):
    from ragcache_integrations import ChunkedPrompt

    prompt = ChunkedPrompt(chunks=PASSAGES, question="Which river reaches the Atlantic?")
    full, _ = tiny_engine.prefill_logits(prompt, policy="full")
    tiny_engine.warm(PASSAGES)
    _, share = tiny_engine.prefill_logits(prompt, policy="cacheblend:0.15")
    fused = sum(s["positions"][1] - s["positions"][0] for s in share.plan if s["mode"] == "fuse")
    assert fused > 20 and share.tokens_recomputed == math.ceil(0.15 * fused)
    _, floored = tiny_engine.prefill_logits(prompt, policy="cacheblend:0.15:min20")
    assert floored.tokens_recomputed == 20
    _, past = tiny_engine.prefill_logits(prompt, policy=f"cacheblend:0.15:min{fused + 50}")
    assert past.tokens_recomputed == fused  # a floor past the fused tokens recomputes them all
    blended, stats = tiny_engine.prefill_logits(prompt, policy="cacheblend:1:min20")
    assert stats.chunk_hits == 2 and (full - blended).abs().max().item() <= 1e-4


def test_the_engines_default_recomputes_at_least_the_floor_on_a_short_context(tiny_engine):
    from ragcache_integrations import ChunkedPrompt
    from ragcache_integrations.policy_registry import DEFAULT_POLICY, parse_policy_spec

    floor = parse_policy_spec(DEFAULT_POLICY).min_tokens
    assert floor > 0
    prompt = ChunkedPrompt(chunks=PASSAGES, question="Which mountain is the highest in Africa?")
    tiny_engine.warm(PASSAGES)
    _, stats = tiny_engine.prefill_logits(prompt)  # no policy: the engine's default
    fused = sum(s["positions"][1] - s["positions"][0] for s in stats.plan if s["mode"] == "fuse")
    assert stats.policy == "cacheblend" and 0.15 * fused < floor
    assert stats.tokens_recomputed == min(fused, floor)
