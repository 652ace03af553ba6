"""Exact prefix reuse through the engine: CP-Tree paths and conversation history."""

from __future__ import annotations

import pytest

from engine_sidecar import Engine
from ragcache_integrations import ChunkedPrompt

PASSAGES = [
    "Lake Baikal in Siberia is the deepest lake in the world, over 1,600 metres deep.",
    "The Sahara is the largest hot desert, covering much of North Africa.",
    "Mount Everest, on the border of Nepal and China, is the highest mountain above sea level.",
    "The Pacific is the largest and deepest of the Earth's five oceans.",
]


@pytest.fixture
def engine(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                prefix_tree=True, promote_threshold=2, fusion_promote_threshold=2) as eng:
        yield eng


def ask(chunks, question="Which is deepest?", conversation_id=None):
    return ChunkedPrompt(chunks=list(chunks), question=question, conversation_id=conversation_id)


def modes(stats):
    return [s["mode"] for s in stats.plan if s["kind"] == "chunk"]


def test_prefix_policy_grows_a_path_and_reuses_it_exactly(engine):
    chunks = PASSAGES[:3]
    full, _ = engine.prefill_logits(ask(chunks), policy="full")  # counts become 1
    _, s2 = engine.prefill_logits(ask(chunks), policy="prefix")  # counts 2: whole path promoted
    assert modes(s2) == ["fresh", "fresh", "fresh"] and s2.chunk_misses == 3
    logits, s3 = engine.prefill_logits(ask(chunks), policy="prefix")
    assert modes(s3) == ["exact", "exact", "exact"] and s3.chunk_hits == 3
    assert (logits - full).abs().max().item() <= 1e-4  # exact reuse: same logits as full prefill
    # prefix slicing: the stored [c1, c2, c3] serves [c1, c2] followed by a new chunk
    _, s4 = engine.prefill_logits(ask(chunks[:2] + [PASSAGES[3]]), policy="prefix")
    assert modes(s4) == ["exact", "exact", "fresh"]


def test_fusion_reuses_chunks_computed_in_place_exactly_after_the_same_tokens(engine):
    chunks = PASSAGES[:3]
    full, _ = engine.prefill_logits(ask(chunks), policy="full")
    _, first = engine.prefill_logits(ask(chunks), policy="cacheblend")
    assert modes(first) == ["fresh"] * 3  # all misses, computed in place
    again, second = engine.prefill_logits(ask(chunks), policy="cacheblend")
    assert modes(second) == ["exact"] * 3 and second.tokens_recomputed == 0
    assert (again - full).abs().max().item() <= 1e-4  # exact: full prefill's logits
    # a shared leading part stays exact; a chunk after other tokens than it was computed after fuses
    assert modes(engine.prefill_logits(ask(chunks[:2] + [PASSAGES[3]]), policy="cacheblend")[1]) == [
        "exact", "exact", "fresh"]
    # (the first one here reached this fixture's promotion count of 2: computed once more as a node)
    assert modes(engine.prefill_logits(ask([chunks[1], chunks[0], chunks[2]]), policy="cacheblend")[1]) == [
        "fresh", "fuse", "fuse"]


def test_fusion_waits_for_a_higher_count_before_paying_for_a_node(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                promote_threshold=2, fusion_promote_threshold=3) as eng:
        orders = [PASSAGES[:2], PASSAGES[1::-1], PASSAGES[1::-1]]
        seen = [modes(eng.generate(ask(order), {"max_tokens": 1}).stats) for order in orders]
    # misses are computed in place on the first ask; in the other order they fuse, and the first
    # chunk, which fusion already holds, becomes a node only at count 3
    assert seen == [["fresh", "fresh"], ["fuse", "fuse"], ["fresh", "fuse"]]


def test_by_default_a_chunk_fusion_holds_is_never_computed_again(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv") as eng:
        orders = [PASSAGES[:3]] + [[PASSAGES[2], PASSAGES[0], PASSAGES[1]]] * 6
        seen = [modes(eng.generate(ask(order), {"max_tokens": 1}).stats) for order in orders]
    assert seen[0] == ["fresh"] * 3
    # however often the new order recurs (the CA-Table counts pass any promotion threshold),
    # every chunk is reused: fused, or exact where it was computed after the same tokens
    assert all("fresh" not in m for m in seen[1:]), seen


def test_evicted_path_kv_is_never_used(engine):
    chunks = PASSAGES[:2]
    for _ in range(3):
        engine.prefill_logits(ask(chunks), policy="prefix")
    assert modes(engine.prefill_logits(ask(chunks), policy="prefix")[1]) == ["exact", "exact"]
    engine.clear_cache(engine.builder.chunk_segment(ask(chunks).chunks[0]).chunk_id)
    _, stats = engine.prefill_logits(ask(chunks), policy="prefix")
    assert "exact" not in modes(stats)


def test_tenants_have_separate_paths(engine):
    chunks = PASSAGES[:2]
    for _ in range(3):
        engine.prefill_logits(ask(chunks), policy="prefix", tenant="a")
    assert modes(engine.prefill_logits(ask(chunks), policy="prefix", tenant="b")[1]) != ["exact", "exact"]


def test_second_turn_reuses_first_turn_kv_exactly(engine):
    engine.generate(ask(PASSAGES[:2], "Which is deepest?", "conv-1"), {"max_tokens": 6}, policy="full")
    follow = ask(PASSAGES[:2], "And which is highest?", "conv-1")
    reused, stats = engine.prefill_logits(follow, policy="prefix")
    assert stats.plan[0]["kind"] == "history" and stats.plan[0]["mode"] == "exact"
    assert stats.chunks_deduplicated == 2  # both chunks are already in the conversation
    recomputed, full_stats = engine.prefill_logits(follow, policy="full")
    assert full_stats.tokens_computed_fresh == full_stats.prefill_tokens_total
    assert full_stats.prefill_tokens_total == stats.prefill_tokens_total
    assert (reused - recomputed).abs().max().item() <= 1e-4


def test_dedup_keeps_only_new_chunks_and_can_be_switched_off(engine, tiny_llama_dir, tmp_path):
    engine.generate(ask(PASSAGES[:2], conversation_id="c"), {"max_tokens": 3})
    result = engine.generate(ask(PASSAGES[1:3], "More?", "c"), {"max_tokens": 3})
    chunk_ids = [s["chunk_id"] for s in result.stats.plan if s["kind"] == "chunk"]
    assert chunk_ids == [ask(PASSAGES[2:3]).chunks[0].id]
    assert result.stats.chunks_deduplicated == 1
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv2",
                                conversation_dedup=False) as no_dedup:
        no_dedup.generate(ask(PASSAGES[:2], conversation_id="c"), {"max_tokens": 3})
        again = no_dedup.generate(ask(PASSAGES[1:3], "More?", "c"), {"max_tokens": 3})
        assert sum(1 for s in again.stats.plan if s["kind"] == "chunk") == 2


def test_dedup_compares_content_not_the_callers_ids(engine):
    from ragcache_integrations.types import Chunk

    engine.generate(ChunkedPrompt(chunks=[Chunk(text=PASSAGES[0], id="doc-1")], question="Deepest?",
                                  conversation_id="c"), {"max_tokens": 2})
    # a new passage under an id the conversation already used is sent, not silently dropped
    reused_id = engine.generate(ChunkedPrompt(chunks=[Chunk(text=PASSAGES[1], id="doc-1")], question="Largest?",
                                              conversation_id="c"), {"max_tokens": 2})
    assert reused_id.stats.chunks_deduplicated == 0
    assert [s["kind"] for s in reused_id.stats.plan].count("chunk") == 1
    # the same text under another id is the same passage: the conversation holds it already
    renamed = engine.generate(ChunkedPrompt(chunks=[Chunk(text=PASSAGES[0], id="other-id")], question="Again?",
                                            conversation_id="c"), {"max_tokens": 2})
    assert renamed.stats.chunks_deduplicated == 1
    assert [s["kind"] for s in renamed.stats.plan].count("chunk") == 0


def test_conversation_over_budget_or_expired_is_dropped_cleanly(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                conversation_max_tokens=60) as eng:
        eng.generate(ask(PASSAGES[:2], conversation_id="big"), {"max_tokens": 2})
        assert len(eng.cache.conversations) == 0  # over its token budget: not kept
        second = eng.generate(ask(PASSAGES[:1], "Next?", "big"), {"max_tokens": 2})
        assert second.stats.plan[0]["kind"] == "prefix"
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                conversation_ttl_s=0.0) as eng:
        eng.generate(ask(PASSAGES[:1], conversation_id="old"), {"max_tokens": 2})
        result = eng.generate(ask(PASSAGES[:1], "Next?", "old"), {"max_tokens": 2})
        assert result.stats.plan[0]["kind"] == "prefix"


def test_kept_conversations_stay_within_their_count_and_byte_budget(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                conversation_max_count=3) as eng:
        for i in range(5):
            eng.generate(ask(PASSAGES[:1], conversation_id=f"c{i}"), {"max_tokens": 2})
        assert len(eng.cache.conversations) == 3 and eng.cache.conversations.evicted == 2
        one = next(iter(eng.cache.conversations._items.values())).history.nbytes
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                conversation_ram_bytes=int(2.5 * one)) as eng:
        for i in range(5):
            eng.generate(ask(PASSAGES[:1], conversation_id=f"c{i}"), {"max_tokens": 2})
            assert eng.cache.conversations.bytes <= eng.config.conversations.ram_bytes
        assert len(eng.cache.conversations) == 2
        # the most recent ones are kept: the next turn of c4 continues from its history
        follow = eng.generate(ask(PASSAGES[:1], "More?", "c4"), {"max_tokens": 2})
        assert follow.stats.plan[0]["kind"] == "history"
