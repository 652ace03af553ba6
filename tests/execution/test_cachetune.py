"""CacheTune: frequency scores on hand-computed signals, and the policy's guards on a real engine."""

from __future__ import annotations

import pytest
import torch

from engine_sidecar.execution.policies import CacheTunePolicy, frequency_scores, parse_policy
from ragcache_integrations import ChunkedPrompt

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
]


def as_kv(signal: list[float]) -> torch.Tensor:
    return torch.tensor(signal).reshape(1, len(signal), 1, 1)  # [L=1, n, Hkv=1, D=1]


def test_spike_low_pass_by_hand():
    # x = [1, 0, 0, 0]: rFFT = [1, 1, 1]; keeping ceil(0.5 * 3) = 2 bins gives
    # x'[t] = (1 + 2 cos(pi t / 2)) / 4 = [0.75, 0.25, -0.25, 0.25]; scores are |x'|
    x = as_kv([1.0, 0.0, 0.0, 0.0])
    assert torch.allclose(frequency_scores(x, x), torch.tensor([0.75, 0.25, 0.25, 0.25]))


def test_constant_signal_passes_unchanged_and_k_v_scores_average():
    ones = as_kv([2.0] * 6)
    zeros = as_kv([0.0] * 6)
    assert torch.allclose(frequency_scores(ones, ones), torch.full((6,), 2.0))
    assert torch.allclose(frequency_scores(ones, zeros), torch.full((6,), 1.0))  # mean of K and V scores


def test_scores_are_averaged_over_layers_and_normed_over_heads():
    keys = torch.zeros(2, 3, 2, 2)
    keys[0] = 3.0  # layer 0: every element 3 -> norm over 2 heads x 2 dims = 6
    scores = frequency_scores(keys, keys, cutoff=1.0)
    assert torch.allclose(scores, torch.full((3,), 3.0))  # (6 + 0) / 2 layers


def test_policy_spec_parses_and_rejects_bad_ratios():
    policy = parse_policy("cachetune:0.3")
    assert isinstance(policy, CacheTunePolicy) and policy.ratio == 0.3
    with pytest.raises(Exception, match="bad argument"):
        parse_policy("cachetune:1.5")


def test_ratio_one_equals_full_prefill_and_small_ratio_recomputes_its_budget(tiny_engine):
    prompt = ChunkedPrompt(chunks=PASSAGES, question="Which river reaches the Atlantic?")
    full, _ = tiny_engine.prefill_logits(prompt, policy="full")
    tiny_engine.warm(PASSAGES)
    tuned, stats = tiny_engine.prefill_logits(prompt, policy="cachetune:1.0")
    assert stats.chunk_hits == 2
    assert (full - tuned).abs().max().item() <= 1e-4
    _, small = tiny_engine.prefill_logits(prompt, policy="cachetune:0.2")
    fused = [s for s in small.plan if s["mode"] == "fuse"]
    budget = sum(-(-(s["positions"][1] - s["positions"][0]) * 2 // 10) for s in fused)  # ceil(0.2 * len)
    assert fused and small.tokens_recomputed == budget
    reuse, _ = tiny_engine.prefill_logits(prompt, policy="reuse")
    assert (reuse - full).abs().max().item() > 1e-3  # so the first check could fail
