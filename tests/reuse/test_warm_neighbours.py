"""Warming a chunk after its nearest passages (context-conditioned chunk KV): which
passages are chosen (TF-IDF worked by hand), that the stored KV is exactly what a request with
those passages before the chunk computes, that fusion uses it and recompute ratio 1.0 still
equals full prefill, and the errors a user can make."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from engine_sidecar import Engine
from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.request.prompt import Segment
from engine_sidecar.reuse.neighbours import NeighbourIndex, cosine
from engine_sidecar.store.entry import IN_CONTEXT
from ragcache_integrations import Chunk, ChunkedPrompt
from tests.conftest import make_tiny_model

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube river flows through ten countries into the Black Sea.",
]


def seg(*ids: int) -> Segment:
    return Segment("chunk", tuple(ids), f"c{ids}")


def test_nearest_passages_by_tf_idf_worked_by_hand():
    p, q, r, s = seg(1, 2, 3), seg(1, 2, 4), seg(5, 6, 7), seg(1, 5, 8)
    index = NeighbourIndex.build([p, q, r, s, seg(1, 2, 4)])  # a duplicate counts once
    assert len(index.segments) == 4
    # idf = ln((1 + n) / (1 + df)) + 1 with n = 4: df 3 (token 1), 2 (tokens 2, 5), 1 (the rest)
    w3, w2, w1 = math.log(5 / 4) + 1, math.log(5 / 3) + 1, math.log(5 / 2) + 1
    norm = w3**2 + w2**2 + w1**2  # every passage here has one token of each document frequency
    vec = dict(zip(index.segments, index.vectors, strict=True))
    assert cosine(vec[p], vec[q]) == pytest.approx((w3**2 + w2**2) / norm)  # tokens 1 and 2 shared
    assert cosine(vec[p], vec[s]) == pytest.approx(w3**2 / norm)  # token 1 only
    assert cosine(vec[p], vec[r]) == 0.0
    assert index.nearest(p, 1) == [q]
    assert index.nearest(p, 2) == [s, q]  # least similar first: the closest sits next to the chunk
    assert index.nearest(p, 9) == [r, s, q]  # never itself
    assert index.nearest(p, 0) == []


def ask(chunks, question="Which river reaches the Atlantic?") -> ChunkedPrompt:
    return ChunkedPrompt(chunks=list(chunks), question=question)


def in_context_entry(engine: Engine, text: str):
    token_ids = engine.builder.chunk_segment(Chunk(text=text)).token_ids
    return engine.cache.store.get(engine.cache.keys.for_tokens(token_ids, "", IN_CONTEXT))


def test_warmed_kv_is_what_a_request_with_those_neighbours_computes(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "a",
                                prefix_tree=False) as warmed, \
         Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "b",
                                prefix_tree=False) as served:
        assert warmed.warm(PASSAGES, neighbours=2) == 3
        assert warmed.warm(PASSAGES, neighbours=2) == 0  # kept
        target = PASSAGES[0]
        index = NeighbourIndex.build([warmed.builder.chunk_segment(Chunk(text=t)) for t in PASSAGES])
        order = index.nearest(warmed.builder.chunk_segment(Chunk(text=target)), 2)
        texts = {warmed.builder.chunk_segment(Chunk(text=t)).token_ids: t for t in PASSAGES}
        before = [texts[s.token_ids] for s in order]
        # a request holding the same passages before the chunk computes it in place (all misses)
        served.generate(ask([*before, target]), {"max_tokens": 1}, policy="cacheblend")
        mine, theirs = in_context_entry(warmed, target), in_context_entry(served, target)
        assert mine.meta["warmed"] == "neighbours" and "chain" not in mine.meta
        assert mine.meta["start"] == theirs.meta["start"]
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5) and torch.allclose(mine.values, theirs.values, atol=1e-5)
        # and it differs from the chunk computed alone: the check above could fail
        alone = warmed.cache.precompute.compute_chunk_kv(warmed.builder.chunk_segment(Chunk(text=target)),
                                                   warmed.builder.prefix_segment("s"), "")
        assert (alone.values - mine.values).abs().max().item() > 1e-3


def test_fusion_uses_the_warmed_kv_and_ratio_one_still_equals_full(tiny_engine):
    tiny_engine.warm(PASSAGES, neighbours=1)
    prompt = ask(PASSAGES[::-1])
    reused, stats = tiny_engine.prefill_logits(prompt, policy="reuse")
    assert (stats.chunk_hits, stats.chunk_misses) == (3, 0)
    for text in PASSAGES:  # no copy computed alone exists: the hits are the neighbour-warmed KV
        token_ids = tiny_engine.builder.chunk_segment(Chunk(text=text)).token_ids
        assert not tiny_engine.cache.store.contains(tiny_engine.cache.keys.for_tokens(token_ids, "", "isolated"))
    full, _ = tiny_engine.prefill_logits(prompt, policy="full")
    everything, _ = tiny_engine.prefill_logits(prompt, policy="cacheblend:1.0")
    assert (everything - full).abs().max().item() <= 1e-4
    assert (reused - full).abs().max().item() > 1e-4  # reuse alone is not full prefill


def whole(builder, text: str) -> int:
    """A passage's tokens in the engine's layout, first and last words included."""
    return sum(len(s.token_ids) for s in builder.passage(Chunk(text=text)).segments)


def test_neighbours_give_way_when_the_window_cannot_hold_them(smol_dir, tmp_path):
    model = make_tiny_model(tmp_path / "short", "llama", tokenizer_from=smol_dir, max_position_embeddings=64)
    with Engine.from_pretrained(model, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                prefix_tree=False) as engine:
        prefix = len(engine.builder.prefix_segment(ChunkedPrompt.model_fields["system"].default).token_ids)
        sizes = [whole(engine.builder, t) for t in PASSAGES]
        assert prefix + sum(sizes) >= 64 and prefix + sizes[0] + max(sizes[1:]) < 64  # room for one only
        assert engine.warm(PASSAGES[:1], neighbours=2, pool=PASSAGES) == 1
        entry = in_context_entry(engine, PASSAGES[0])
        assert len(entry.meta["after_chunks"].split(",")) == 1


def test_bad_neighbour_counts_are_clear_errors(tiny_engine, tiny_llama_dir, tmp_path):
    for bad in (-1, 9):
        with pytest.raises(InvalidPromptError, match="neighbours must be 0 to 8"):
            tiny_engine.warm(PASSAGES, neighbours=bad)
    chunk = tmp_path / "chunk.txt"
    chunk.write_text(PASSAGES[0], encoding="utf-8")
    env = {**os.environ, "RAGCACHE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "warm", str(chunk), "--neighbours", "9",
                           "--model", str(tiny_llama_dir), "--no-disk"], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "neighbours must be 0 to 8" in lines[0], proc.stderr


def test_an_unset_neighbour_count_warms_passages_known_together_after_two(tiny_engine):
    builder = tiny_engine.builder
    prefix = len(builder.prefix_segment(ChunkedPrompt.model_fields["system"].default).token_ids)
    sizes = {t: whole(builder, t) for t in PASSAGES}
    report = tiny_engine.warm_report(PASSAGES)
    assert (report.chunks, report.computed, report.neighbours) == (3, 3, 2)
    # three passages, each computed after the other two (whole) and its own first word: every
    # passage twice whole and once up to its last word, and the template prefix once (the first
    # chunk stores it; the others start from it)
    up_to_core = sum(len(builder.passage(Chunk(text=t)).head.token_ids)
                     + len(builder.chunk_segment(Chunk(text=t)).token_ids) for t in PASSAGES)
    assert report.tokens_prefilled == prefix + 2 * sum(sizes.values()) + up_to_core
    assert report.seconds > 0
    for text in PASSAGES:
        entry = in_context_entry(tiny_engine, text)
        assert entry is not None and entry.meta["warmed"] == "neighbours"
        assert len(entry.meta["after_chunks"].split(",")) == 2
    again = tiny_engine.warm_report(PASSAGES)
    assert (again.computed, again.tokens_prefilled) == (0, 0)  # kept: nothing prefilled


def test_a_lone_passage_and_an_explicit_zero_warm_alone(tiny_engine):
    lone = tiny_engine.warm_report([PASSAGES[0], PASSAGES[0]])  # one distinct passage: nothing to come after
    assert (lone.neighbours, lone.computed) == (0, 1)
    assert in_context_entry(tiny_engine, PASSAGES[0]) is None
    alone = tiny_engine.warm_report(PASSAGES[1:], neighbours=0)
    assert (alone.neighbours, alone.computed) == (0, 2)
    assert all(in_context_entry(tiny_engine, t) is None for t in PASSAGES[1:])


def test_the_engine_warm_call_still_computes_alone_unless_told(tiny_engine):
    # benchmarks measure KV computed alone through it
    assert tiny_engine.warm(PASSAGES) == 3
    assert all(in_context_entry(tiny_engine, t) is None for t in PASSAGES)


def test_the_warm_command_defaults_to_neighbours_and_prints_the_cost(tiny_llama_dir, tmp_path):
    files = []
    for i, text in enumerate(PASSAGES):
        files.append(tmp_path / f"chunk{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    env = {**os.environ, "RAGCACHE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    base = [sys.executable, "-m", "engine_sidecar.cli", "warm", "--model", str(tiny_llama_dir), "--no-disk"]
    together = subprocess.run([*base, *map(str, files)], capture_output=True, text=True, env=env, timeout=300)
    assert together.returncode == 0, together.stderr
    assert "precomputed 3 of 3 chunks (after their 2 nearest passages):" in together.stdout
    assert "tokens prefilled in" in together.stdout
    one = subprocess.run([*base, str(files[0])], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0 and "precomputed 1 of 1 chunks (alone)" in one.stdout, one.stderr
