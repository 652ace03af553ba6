"""CacheBlend's check-layer pick by hand: the top deviations among the fused rows, with the kept
count known on the host (no read-back of the mask on a GPU) and equal to the mask's."""

from __future__ import annotations

import math

import pytest
import torch

from engine_sidecar.execution.executor import kept_indices
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
    policy._fused_total = 9  # what initial_active counted: the nine cached rows
    keep = policy.refine(_view(must_keep, new_v, all_v, host_count))
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
    policy._fused_total = 10  # more than the two rows left to choose from
    keep = policy.refine(_view(must_keep, torch.ones(4, 1, 2), torch.zeros(4, 1, 2), host_count=True))
    assert isinstance(keep, KeptRows) and keep.mask.all() and keep.count == 4
