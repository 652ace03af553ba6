"""Misses computed in place: a chunk without stored KV costs what full prefill pays for
it, once, and is kept for the next request. Counts of token-layers, never times."""

from __future__ import annotations

import math

import pytest

from engine_sidecar import Engine
from engine_sidecar.errors import InvalidPromptError
from ragcache_integrations import Chunk, ChunkedPrompt

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]


def ask(chunks, question="Which river reaches the Atlantic?") -> ChunkedPrompt:
    return ChunkedPrompt(chunks=list(chunks), question=question)


def span_tokens(stats, mode: str) -> int:
    return sum(s["positions"][1] - s["positions"][0] for s in stats.plan if s["mode"] == mode)


def test_all_miss_request_costs_exactly_full_prefill_and_answers_like_it(tiny_engine):
    layers = tiny_engine.runner.num_layers
    full = tiny_engine.generate(ask(PASSAGES), {"max_tokens": 8}, policy="full")
    fused = tiny_engine.generate(ask(PASSAGES), {"max_tokens": 8}, policy="cacheblend:0.15")
    assert fused.stats.chunk_misses == 3 and fused.stats.chunk_hits == 0
    assert fused.stats.token_layers_computed == full.stats.token_layers_computed
    assert fused.stats.token_layers_computed == fused.stats.prefill_tokens_total * layers
    assert fused.stats.token_layers_precomputed == 0 and fused.stats.computed_fraction == 1.0
    assert fused.token_ids == full.token_ids


def test_hits_and_misses_compute_each_miss_once_and_nothing_twice(tiny_engine):
    layers = tiny_engine.runner.num_layers
    tiny_engine.generate(ask(PASSAGES[:2]), {"max_tokens": 1})  # both computed in place and kept
    stats = tiny_engine.generate(ask([PASSAGES[1], PASSAGES[2], PASSAGES[0]]), {"max_tokens": 1},
                                 policy="cacheblend:0.2").stats
    assert (stats.chunk_hits, stats.chunk_misses) == (2, 1)
    chunk_modes = [s["mode"] for s in stats.plan if s["kind"] == "chunk"]
    assert chunk_modes == ["fuse", "fresh", "fuse"]
    fused, fresh = span_tokens(stats, "fuse"), span_tokens(stats, "fresh")
    exact = span_tokens(stats, "exact")  # the template prefix, stored by the first request
    assert exact > 0 and exact + fused + fresh == stats.prefill_tokens_total
    # CacheBlend: every fused token in layer 0; from the check layer (1) on, the top 20%
    budget = math.ceil(0.2 * fused)
    expected = fresh * layers + fused + budget * (layers - 1)
    assert stats.token_layers_computed == expected and stats.token_layers_precomputed == 0
    assert stats.tokens_recomputed == budget
    # the miss was kept: the same chunks in yet another order are all hits
    again = tiny_engine.generate(ask(PASSAGES[::-1]), {"max_tokens": 1}).stats
    assert (again.chunk_hits, again.chunk_misses) == (3, 0)


def test_in_place_kv_in_its_own_order_reproduces_full_prefill(tiny_engine):
    full, _ = tiny_engine.prefill_logits(ask(PASSAGES), policy="full")
    tiny_engine.prefill_logits(ask(PASSAGES), policy="cacheblend")  # all computed in place
    reused, stats = tiny_engine.prefill_logits(ask(PASSAGES, "Another question?"), policy="reuse")
    assert stats.chunk_hits == 3 and stats.tokens_recomputed == 0
    reference, _ = tiny_engine.prefill_logits(ask(PASSAGES, "Another question?"), policy="full")
    # KV kept from the same arrangement is exactly full prefill's: nothing left to repair
    assert (reused - reference).abs().max().item() <= 1e-4
    assert (full - reference).abs().max().item() > 1e-4  # another question: the check above can fail


def first_words(engine) -> int:
    """Tokens of the passages' first words, which a chunk's precompute computes before its core."""
    return sum(len(engine.builder.passage(Chunk(text=t)).head.token_ids) for t in PASSAGES)


def test_inline_precompute_is_counted_as_work(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                prefix_tree=False, precompute="inline") as engine:
        layers = engine.runner.num_layers
        stats = engine.generate(ask(PASSAGES), {"max_tokens": 1}, policy="cacheblend:0.2").stats
        fused, fresh = span_tokens(stats, "fuse"), span_tokens(stats, "fresh")
        assert stats.chunk_misses == 3 and fused > 0
        # each chunk computed alone first, after its first word (as `warm` computes it)
        assert stats.token_layers_precomputed == (fused + first_words(engine)) * layers
        prefill = fresh * layers + fused + math.ceil(0.2 * fused) * (layers - 1)
        assert stats.token_layers_computed == stats.token_layers_precomputed + prefill
        assert stats.computed_fraction > 1.0  # a miss costs more than full prefill pays for it
        assert "precompute_s" in stats.stage_times


def test_background_work_is_reported_apart(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                prefix_tree=False, precompute="background") as engine:
        layers = engine.runner.num_layers
        stats = engine.generate(ask(PASSAGES), {"max_tokens": 1}).stats
        chunk_tokens = sum(s["positions"][1] - s["positions"][0] for s in stats.plan if s["kind"] == "chunk")
        assert stats.token_layers_background == (chunk_tokens + first_words(engine)) * layers
        assert stats.token_layers_computed == stats.prefill_tokens_total * layers


@pytest.mark.parametrize("tenant", ["acme", "globex"])
def test_in_place_kv_is_per_tenant(tiny_engine, tenant):
    tiny_engine.generate(ask(PASSAGES), {"max_tokens": 1}, tenant="acme")
    stats = tiny_engine.generate(ask(PASSAGES[::-1]), {"max_tokens": 1}, tenant=tenant).stats
    assert stats.chunk_hits == (3 if tenant == "acme" else 0)


def test_hits_first_order_puts_held_chunks_before_new_ones(tiny_engine):
    """order="hits-first": chunks the store holds (warmed, or computed in place by an earlier
    request) go first, each group in the retriever's order."""
    a, b, c = (Chunk(id=i, text=t) for i, t in zip("abc", (
        "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
        "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
        "The Danube passes through ten countries, more than any other river in the world."), strict=True))
    tiny_engine.warm([c])
    first = tiny_engine.generate(ChunkedPrompt(chunks=[a, b, c], question="q?"), {"max_tokens": 1},
                                 order="hits-first")
    assert [s["chunk_id"] for s in first.stats.plan if s["kind"] == "chunk"] == ["c", "a", "b"]
    assert first.stats.chunk_hits == 1
    # a and b were computed in place by that request: now all three are held, retriever order kept
    second = tiny_engine.generate(ChunkedPrompt(chunks=[b, a, c], question="q?"), {"max_tokens": 1},
                                  order="hits-first")
    assert [s["chunk_id"] for s in second.stats.plan if s["kind"] == "chunk"] == ["b", "a", "c"]
    with pytest.raises(InvalidPromptError, match="misses-first"):
        tiny_engine.generate(ChunkedPrompt(chunks=[a], question="q?"), order="newest-first")


def test_misses_first_order_puts_new_chunks_before_held_ones_and_computes_them_once(tiny_engine):
    """order="misses-first": new chunks go first (in the retriever's order), held ones after;
    the new chunk is computed in place in every layer, the held one is fused, nothing twice."""
    a, b, c = (Chunk(id=i, text=t) for i, t in zip("abc", (
        "The Nile is the longest river in Africa and flows north into the Mediterranean Sea.",
        "Lake Baikal in Siberia is the deepest lake in the world, at 1,642 metres.",
        "The Atacama Desert in Chile is one of the driest places on Earth."), strict=True))
    tiny_engine.warm([a])
    result = tiny_engine.generate(ChunkedPrompt(chunks=[a, b, c], question="q?"), {"max_tokens": 1},
                                  order="misses-first", policy="reuse")
    plan = [s for s in result.stats.plan if s["kind"] == "chunk"]
    assert [s["chunk_id"] for s in plan] == ["b", "c", "a"]
    assert result.stats.chunk_hits == 1 and result.stats.chunk_misses == 2
    layers = tiny_engine.runner.num_layers
    new_tokens = result.stats.prefill_tokens_total - result.stats.tokens_reused
    assert result.stats.token_layers_computed == new_tokens * layers
    assert result.stats.token_layers_precomputed == 0
