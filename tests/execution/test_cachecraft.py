"""Cache-Craft: each formula on small hand-computed cases, then the policy in the engine (variants
recorded in a request's context, reused elsewhere; ratio-1 recompute equals full prefill;
eviction; tenants)."""

from __future__ import annotations

import math

import pytest
import torch

from engine_sidecar.execution.cachecraft import (
    Variant,
    VariantIndex,
    adjusted_overlap,
    cache_context_impact,
    cache_fix_overhead,
    focused_chunks,
    kendall_tau_distance,
    layer_scores,
    prefix_overlap,
    recompute_count,
    termination_layer,
    tokens_to_recompute,
)
from engine_sidecar.execution.policies import CacheCraftPolicy, parse_policy
from engine_sidecar.store.entry import CacheKey


def test_layer_scores_by_hand():
    # chunk = positions [2, 4), one prior chunk [0, 2); rows are the chunk's two tokens
    probs = torch.tensor([[0.25, 0.25, 0.5, 0.0], [0.1, 0.1, 0.4, 0.4]])
    a, b, inter = layer_scores(probs, (2, 4), [(0, 2)])
    assert a == pytest.approx((0.25 + 0.25 + 0.1 + 0.1) / (2 * 2))
    assert b == pytest.approx((0.5 + 0.4 + 0.4) / (2 * 2))
    assert torch.allclose(inter, torch.tensor([0.5, 0.2]))


def test_two_prior_chunks_are_normalized_by_each_size():
    probs = torch.tensor([[0.2, 0.1, 0.3, 0.4]])  # chunk [3, 4) after chunks [0, 1) and [1, 3)
    a, b, inter = layer_scores(probs, (3, 4), [(0, 1), (1, 3)])
    assert a == pytest.approx(0.2 / 1 + 0.4 / 2)
    assert b == pytest.approx(0.4)
    assert torch.allclose(inter, torch.tensor([0.6]))


def test_cci_is_a_sigmoid_of_inter_over_intra():
    assert cache_context_impact(0.175, 0.325) == pytest.approx(1 / (1 + math.exp(-0.175 / 0.325)))
    assert cache_context_impact(0.0, 0.5) == pytest.approx(0.5)  # no context at all
    assert cache_context_impact(0.3, 0.0) == 1.0


def test_prefix_overlap_kendall_tau_and_cfo_by_hand():
    assert prefix_overlap(["A", "B", "C"], ["B", "C", "D"]) == pytest.approx(2 / 3)
    assert prefix_overlap([], []) == 1.0 and prefix_overlap([], ["A"]) == 0.0
    assert kendall_tau_distance(["A", "B", "C"], ["C", "B", "A"]) == 1.0
    assert kendall_tau_distance(["A", "B", "C"], ["A", "C", "B"]) == pytest.approx(1 / 3)
    assert kendall_tau_distance(["A", "B", "X"], ["B", "Y", "A"]) == 1.0  # only the shared pair counts
    assert kendall_tau_distance(["A"], ["A"]) == 0.0
    beta_adj = adjusted_overlap(2 / 3, 1 / 3)
    assert beta_adj == pytest.approx(4 / 9)
    assert cache_fix_overhead(0.5, 0.6, beta_adj) == pytest.approx(0.5 * 0.6 * 5 / 9)
    assert cache_fix_overhead(5.0, 0.9, 0.0) == 1.0  # clipped
    assert recompute_count(1 / 6, 12) == 2 and recompute_count(0.2, 35) == 7 and recompute_count(0.0, 9) == 0


def test_tokens_to_recompute_takes_top_inter_attention_and_ties_go_first():
    inter = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.0, 0.2])
    assert tokens_to_recompute(inter, 2 / 6).tolist() == [1, 3]
    assert tokens_to_recompute(torch.zeros(5), 0.4).tolist() == [0, 1]


def variant(name: str, prefix: tuple[str, ...], cci: float = 0.5) -> Variant:
    return Variant("", "chunk", prefix, cci, torch.zeros(3), CacheKey("m", "t", name, "", "cc"))


def test_variant_choice_and_frequency_reuse_eviction():
    index = VariantIndex(per_chunk=2, max_chunks=10)
    far, near = variant("far", ("X", "Y"), cci=0.9), variant("near", ("A", "B"), cci=0.9)
    index.add(far)
    index.add(near)
    choice = index.choose("", "chunk", ["A", "B"], alpha=1.0)
    assert choice is not None and choice.variant is near and choice.cfo == 0.0
    assert index.choose("other-tenant", "chunk", ["A", "B"], alpha=1.0) is None
    index.reward(far, 0.5)  # f_r = 2
    index.reward(near, 0.25)  # f_r = 4
    evicted = index.add(variant("new", ("C",)))
    assert evicted == [far]  # lowest f_r leaves first
    assert {v.key.tokens_digest for v in index.variants("", "chunk")} == {"near", "new"}


def test_total_capacity_evicts_across_chunks():
    index = VariantIndex(per_chunk=2, max_chunks=1)
    a, b = variant("a", ("P",)), variant("b", ("Q",))
    index.add(a)
    index.add(b)
    index.reward(a, 0.1)
    other = Variant("", "chunk2", (), 0.5, torch.zeros(2), CacheKey("m", "t", "c", "", "cc"))
    assert index.add(other) == [b]
    assert len(index) == 2


def test_focused_chunks_and_the_termination_window():
    assert focused_chunks([0.5, 0.3, 0.2]) == {0}
    assert focused_chunks([0.4, 0.4, 0.2]) == {0, 1}
    assert focused_chunks([0.0, 0.0]) == frozenset()
    history = [frozenset({0}), frozenset({0, 1}), frozenset({0, 1}), frozenset({0, 1})]
    assert termination_layer(history, 3) and not termination_layer(history, 4)


def test_policy_parsing():
    pol = parse_policy("cachecraft:0.5")
    assert isinstance(pol, CacheCraftPolicy) and pol.alpha == 0.5 and pol.early_stop
    assert not parse_policy("cachecraft:1:nostop").early_stop


# --- in the engine ----------------------------------------------------------------------------
A = "The Nile is a river in Africa. It flows north through Egypt into the Mediterranean Sea near Alexandria."
B = "Mount Fuji is the highest mountain in Japan, 3,776 metres high, near Tokyo, an active volcano."
C = "The Great Barrier Reef is the largest coral reef system, off Queensland, Australia, visible from space."


@pytest.fixture
def engine(tiny_engine):
    """The shared tiny engine (CP-Tree off), named for what these tests do with it."""
    return tiny_engine


def test_first_sight_records_variants_then_a_new_order_reuses_them(engine):
    first = engine.generate({"chunks": [A, B, C], "question": "Where?"}, {"max_tokens": 2}, policy="cachecraft")
    assert first.stats.chunk_misses == 3 and first.stats.chunk_hits == 0 and len(engine.cache.variants) == 3
    second = engine.generate({"chunks": [C, A, B], "question": "Where?"}, {"max_tokens": 2},
                             policy="cachecraft:0.5")
    assert second.stats.chunk_hits == 3 and second.stats.tokens_reused > 0
    assert len([n for n in second.stats.notes if n.startswith("cachecraft")]) == 3
    assert len(engine.cache.variants) == 3  # hits add no variants


def test_cfo_one_recompute_without_early_stop_equals_full_prefill(engine):
    engine.generate({"chunks": [A, B, C], "question": "Where?"}, {"max_tokens": 1}, policy="cachecraft")
    prompt = {"chunks": [C, B, A], "question": "Which river?"}
    full, _ = engine.prefill_logits(prompt, policy="full")
    everything = CacheCraftPolicy(alpha=1000.0, early_stop=False, fresh_above=2.0)  # CFO 1: all tokens
    crafted, stats = engine.prefill_logits(prompt, policy=everything)
    assert stats.chunk_hits == 3 and stats.tokens_recomputed > 0
    assert torch.allclose(crafted, full, atol=1e-4)
    engine.warm([A, B, C])  # isolated KV, so plain reuse below really reuses
    reused, stats = engine.prefill_logits(prompt, policy="reuse")
    assert stats.chunk_hits == 3
    assert not torch.allclose(reused, full, atol=1e-4)  # so the guard above could fail


def test_same_prefix_same_order_needs_no_recompute(engine):
    engine.generate({"chunks": [A, B], "question": "Where?"}, {"max_tokens": 1}, policy="cachecraft")
    again = engine.generate({"chunks": [A, B], "question": "Which one?"}, {"max_tokens": 1}, policy="cachecraft")
    assert again.stats.chunk_hits == 2 and again.stats.tokens_recomputed == 0
    assert any("beta 1.00, gamma 0.00, CFO 0.00" in n for n in again.stats.notes)


def test_variants_are_per_tenant(engine):
    engine.generate({"chunks": [A, B], "question": "Where?"}, {"max_tokens": 1}, policy="cachecraft", tenant="t1")
    other = engine.generate({"chunks": [A, B], "question": "Where?"}, {"max_tokens": 1}, policy="cachecraft",
                            tenant="t2")
    assert other.stats.chunk_hits == 0 and other.stats.chunk_misses == 2


def test_costly_fix_makes_a_new_variant_and_eviction_drops_the_old_kv(tiny_llama_dir):
    from engine_sidecar import Engine
    from engine_sidecar.request.fingerprint import token_ids_digest
    from ragcache_integrations.types import Chunk

    eng = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", disk=False, prefix_tree=False,
                                 cachecraft_variants_per_chunk=1)
    try:
        eng.generate({"chunks": [A, C], "question": "Q"}, {"max_tokens": 1}, policy="cachecraft")
        c_digest = token_ids_digest(list(eng.builder.chunk_segment(Chunk(text=C)).token_ids))
        (old,) = eng.cache.variants.variants("", c_digest)
        assert old.prefix and eng.cache.store.contains(old.key)
        # after B instead of A: beta 0, CFO = alpha * CCI >= 0.8 with alpha 2 -> computed here
        eng.generate({"chunks": [B, C], "question": "Q"}, {"max_tokens": 1}, policy="cachecraft:2")
        (new,) = eng.cache.variants.variants("", c_digest)  # M = 1: the old variant was evicted
        assert new.prefix != old.prefix
        assert not eng.cache.store.contains(old.key) and eng.cache.store.contains(new.key)
    finally:
        eng.close()


def test_focused_chunk_early_termination_stops_recompute_of_unfocused_chunks(engine):
    engine.generate({"chunks": [A, B, C], "question": "Where?"}, {"max_tokens": 1}, policy="cachecraft")
    prompt = {"chunks": [C, B, A], "question": "Which river flows into the Mediterranean Sea?"}
    keep_going = CacheCraftPolicy(alpha=0.5, early_stop=False)  # CFO <= 0.5: every chunk reuses a variant
    _, full_stats = engine.prefill_logits(prompt, policy=keep_going)
    stopping = CacheCraftPolicy(alpha=0.5, window=1)  # stop as soon as the focused set is seen once
    _, stats = engine.prefill_logits(prompt, policy=stopping)
    assert stats.policy_decisions["stopped_at"] == 0  # window 1: decided at the first layer
    assert full_stats.policy_decisions["stopped_at"] is None
    assert stats.chunk_hits == full_stats.chunk_hits == 3
    assert stats.tokens_recomputed < full_stats.tokens_recomputed  # unfocused chunks dropped out
    assert stats.computed_fraction < full_stats.computed_fraction


@pytest.mark.parametrize("window", [2, 3])
def test_early_termination_waits_for_a_stable_focused_set_over_the_window(engine, window):
    engine.generate({"chunks": [A, B, C], "question": "Where?"}, {"max_tokens": 1}, policy="cachecraft")
    prompt = {"chunks": [C, B, A], "question": "Which river flows into the Mediterranean Sea?"}
    policy = CacheCraftPolicy(alpha=0.5, window=window)
    _, stats = engine.prefill_logits(prompt, policy=policy)
    decided = stats.policy_decisions
    # the focused set seen at each layer, until the stop
    history = [frozenset(seen) for seen in decided["focused_by_layer"]]
    first_stable = next((i for i in range(len(history)) if termination_layer(history[: i + 1], window)), None)
    stopped_at = decided["stopped_at"]
    assert stopped_at == first_stable  # the first layer where `window` layers agreed, never before
    if stopped_at is not None:
        assert stopped_at >= window - 1
        assert len(set(history[stopped_at - window + 1 : stopped_at + 1])) == 1


def test_variants_survive_a_restart_through_the_disk_tier(tiny_llama_dir, tmp_path):
    from engine_sidecar import Engine

    def start() -> Engine:
        return Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                      prefix_tree=False)

    with start() as first:
        first.generate({"chunks": [A, B, C], "question": "Where?"}, {"max_tokens": 1}, policy="cachecraft")
        recorded = {(v.chunk_digest, v.prefix, round(v.cci, 6)) for vs in first.cache.variants._by_chunk.values() for v in vs}
    with start() as second:
        assert len(second.cache.variants) == 0  # rebuilt on the first Cache-Craft request, not before
        again = second.generate({"chunks": [C, A, B], "question": "Where?"}, {"max_tokens": 1},
                                policy="cachecraft:0.5")
        assert again.stats.chunk_hits == 3 and again.stats.chunk_misses == 0
        rebuilt = {(v.chunk_digest, v.prefix, round(v.cci, 6)) for vs in second.cache.variants._by_chunk.values() for v in vs}
        assert rebuilt == recorded
        second.clear_cache()
        assert len(second.cache.variants) == 0
        cold = second.generate({"chunks": [C, A, B], "question": "Where?"}, {"max_tokens": 1}, policy="cachecraft")
        assert cold.stats.chunk_misses == 3
