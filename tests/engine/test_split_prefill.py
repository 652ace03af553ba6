"""The prefill shared with another engine (the vLLM connector's engine side): ragcache computes
the leading spans, the other engine the rest, and ragcache keeps what was new from the KV the
other engine holds (split_prefill.py). The "other engine" here is ragcache's own full prefill, so
what is learned can be compared with what ragcache would have computed itself."""

from __future__ import annotations

import torch

from ragcache_integrations.types import Chunk, ChunkedPrompt

TEXTS = {"a": "The river Saone meets the Rhone at Lyon, in the south-east of France. " * 3,
         "b": "Sourdough rises with wild yeast and lactic acid bacteria from a starter. " * 3,
         "c": "The far side of the Moon was first photographed by Luna 3 in 1959. " * 3}


def prompt(order: str, question: str = "Where do the rivers meet?") -> ChunkedPrompt:
    return ChunkedPrompt(chunks=[Chunk(text=TEXTS[c], id=c) for c in order], question=question)


def full_kv(engine, p: ChunkedPrompt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, result, _ = engine.probes.prefill_kv(p, "full")  # full commits nothing
    n = len(ids)
    return result.kv.keys[:, :n], result.kv.values[:, :n], result.kv.keys_pre[:, :n]


def chunk_entries(engine, chunk_id: str) -> list:
    digests = engine.cache.store.chunk_id_index().get(chunk_id, set())
    return [engine.cache.store.ram.get(d) for d in digests]


def test_nothing_supplied_then_learned_from_the_other_engines_kv(tiny_engine):
    engine = tiny_engine
    first = prompt("ab")
    run = engine.split.prefix(first, "cacheblend", "", upto=0)
    assert run.end == 0 and run.result is None and run.chunk_hits == 0 and run.token_layers == 0
    keys, values, keys_pre = full_kv(engine, first)
    engine.split.learn(run, keys, values)
    [entry] = chunk_entries(engine, "a")
    span = next(s for s in run.planned.plan.spans if s.chunk_id == "a")
    # stored position-free: the other engine's rotated keys, rotated back
    assert torch.allclose(entry.keys, keys_pre[:, span.start : span.end], atol=1e-4)
    assert torch.equal(entry.values, values[:, span.start : span.end])
    # the next request finds both chunks and supplies them fused
    again = engine.split.prefix(prompt("ba", "What makes sourdough rise?"), "cacheblend", "", upto=10_000)
    assert again.chunk_hits == 2
    assert 0 < again.token_layers < again.end * engine.runner.num_layers


def test_the_prefix_run_covers_whole_spans_up_to_the_limit(tiny_engine):
    engine = tiny_engine
    p = prompt("abc")
    spans = engine.split.prefix(p, "full", "", upto=0).planned.plan.spans
    b = next(s for s in spans if s.chunk_id == "b")
    run = engine.split.prefix(p, "full", "", upto=b.start + 1)
    assert run.end == b.end  # the span that starts before the limit is computed whole
    keys, _, _ = full_kv(engine, p)
    # ragcache's rows equal its own full prefill's (causal: the rest of the prompt cannot matter)
    assert torch.allclose(run.result.kv.keys[:, : run.end], keys[:, : run.end], atol=1e-5)


def test_a_learned_chunk_stays_with_its_tenant(tiny_engine):
    engine = tiny_engine
    p = prompt("ab")
    run = engine.split.prefix(p, "cacheblend", "team-a", upto=0)
    keys, values, _ = full_kv(engine, p)
    engine.split.learn(run, keys, values)
    assert engine.split.prefix(p, "cacheblend", "team-a", upto=10_000).chunk_hits == 2
    assert engine.split.prefix(p, "cacheblend", "team-b", upto=10_000).chunk_hits == 0


def test_a_prefix_reused_exactly_computes_nothing(tiny_engine):
    # the same chunks after the same tokens: stored with their chain, reused exactly; only the
    # passages' first and last words are active (the question is the other engine's to compute)
    engine = tiny_engine
    p = prompt("ab")
    run = engine.split.prefix(p, "cacheblend", "", upto=0)
    keys, values, _ = full_kv(engine, p)
    engine.split.learn(run, keys, values)
    question = next(s for s in run.planned.plan.spans if s.kind == "question")
    again = engine.split.prefix(p, "cacheblend", "", upto=question.start)
    words = sum(len(s) for s in again.planned.plan.spans if s.kind == "separator")
    assert [s.mode for s in again.planned.plan.spans if s.kind in ("prefix", "chunk")] == ["exact"] * 3
    assert again.chunk_hits == 2 and again.token_layers == words * engine.runner.num_layers
    assert again.end == question.start
    assert torch.allclose(again.result.kv.keys[:, : again.end], keys[:, : again.end], atol=1e-4)


def test_a_shared_prefill_is_measured_like_any_request(tiny_engine):
    """ragcache's part of a prefill shared with vLLM runs on the engine's one prefill path: its
    compute cost feeds the cost meter (`:auto` ratios, Cache-Craft's preload depth) as any
    request's does."""
    engine = tiny_engine
    assert engine.cache.costs.compute is None  # nothing ran yet
    run = engine.split.prefix(prompt("ab"), "full", "", upto=10_000)
    assert run.result is not None and run.result.logits is None  # another engine computes the logits
    assert engine.cache.costs.compute is not None and engine.cache.costs.compute > 0
