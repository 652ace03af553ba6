"""Fused-prefill engine behaviour on a tiny random Llama with the real SmolLM2 tokenizer."""

from __future__ import annotations

import logging

import pytest
import torch

from engine_sidecar import Engine
from engine_sidecar.errors import InvalidPromptError, PromptTooLongError
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import ReusePolicy
from engine_sidecar.store.entry import ChunkKV
from ragcache_integrations import ChunkedPrompt
from tests.conftest import make_tiny_model

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]


def prompt(chunks=PASSAGES, question="Which river reaches the Atlantic?") -> ChunkedPrompt:
    return ChunkedPrompt(chunks=list(chunks), question=question)


def test_cacheblend_ratio_one_reproduces_full(tiny_engine):
    full, _ = tiny_engine.prefill_logits(prompt(), policy="full")
    tiny_engine.warm(PASSAGES)
    blended, stats = tiny_engine.prefill_logits(prompt(), policy="cacheblend:1.0")
    assert stats.chunk_hits == 3
    assert (full - blended).abs().max().item() <= 1e-4


def test_focus_ratio_one_reproduces_full_and_small_ratio_recomputes_budget(tiny_engine):
    full, _ = tiny_engine.prefill_logits(prompt(), policy="full")
    tiny_engine.warm(PASSAGES)
    focused, _ = tiny_engine.prefill_logits(prompt(), policy="focus:1.0")
    assert (full - focused).abs().max().item() <= 1e-4
    _, stats = tiny_engine.prefill_logits(prompt(), policy="focus:0.2")
    fused = sum(s["positions"][1] - s["positions"][0] for s in stats.plan if s["mode"] == "fuse")
    assert stats.tokens_recomputed == -(-fused * 2 // 10)  # ceil(0.2 * fused tokens)


def test_reuse_differs_from_full_so_the_check_above_can_fail(tiny_engine):
    full, _ = tiny_engine.prefill_logits(prompt(), policy="full")
    tiny_engine.warm(PASSAGES)
    reused, stats = tiny_engine.prefill_logits(prompt(), policy="reuse")
    assert stats.tokens_recomputed == 0 and stats.tokens_reused > 0
    assert (full - reused).abs().max().item() > 1e-3


def test_chunk_at_position_zero_reproduces_fresh_compute(tiny_engine):
    runner = tiny_engine.runner
    chunk = tiny_engine.builder.chunk_segment(prompt().chunks[0])
    question = tiny_engine.builder.encode("Where does it flow?")
    # the isolated convention computes a chunk alone at position 0: exactly this placement
    kv = tiny_engine.cache.precompute.compute_chunk_kv(chunk, tiny_engine.builder.prefix_segment("s"), "")
    n = len(chunk.token_ids)
    plan = FusionPlan([PlanSpan("chunk", 0, chunk.token_ids, "fuse", kv),
                       PlanSpan("question", n, question, "fresh")], "reuse")
    fused = fused_prefill(runner, plan, ReusePolicy()).logits
    fresh = runner.forward(torch.tensor(list(chunk.token_ids) + list(question)))[-1]
    assert (fused - fresh).abs().max().item() <= 1e-4


def test_same_request_twice_is_a_full_hit_with_same_answer(tiny_engine):
    first = tiny_engine.generate(prompt(), {"max_tokens": 6})
    second = tiny_engine.generate(prompt(), {"max_tokens": 6})
    assert first.stats.chunk_misses == 3
    assert second.stats.chunk_hits == 3 and second.stats.chunk_misses == 0
    assert second.stats.tokens_computed_fresh < first.stats.prefill_tokens_total
    assert second.token_ids == first.token_ids


@pytest.mark.parametrize(
    "chunks",
    [list(reversed(PASSAGES)), [], [PASSAGES[0], PASSAGES[0]], ["", PASSAGES[1]]],
    ids=["reordered", "empty-list", "repeated-chunk", "empty-chunk"],
)
def test_awkward_chunk_sets_answer_without_error(tiny_engine, chunks):
    tiny_engine.warm(PASSAGES)
    full, _ = tiny_engine.prefill_logits(prompt(chunks), policy="full")
    # every token planned once and computed where the plan says: ratio 1.0 is full prefill
    blended, stats = tiny_engine.prefill_logits(prompt(chunks), policy="cacheblend:1.0")
    assert (full - blended).abs().max().item() <= 1e-4
    assert stats.chunk_misses == 0
    assert stats.chunk_hits == sum(1 for c in chunks if c.strip())
    positions = [s["positions"] for s in stats.plan]
    assert positions[0][0] == 0 and all(a[1] == b[0] for a, b in zip(positions, positions[1:], strict=False))
    assert positions[-1][1] == stats.prefill_tokens_total
    result = tiny_engine.generate(prompt(chunks), {"max_tokens": 4})
    assert result.token_ids and result.stats.chunk_misses == 0


def test_other_tenant_misses(tiny_engine):
    tiny_engine.warm(PASSAGES, tenant="acme")
    same = tiny_engine.generate(prompt(), {"max_tokens": 2}, tenant="acme")
    other = tiny_engine.generate(prompt(), {"max_tokens": 2}, tenant="globex")
    assert same.stats.chunk_hits == 3
    assert other.stats.chunk_hits == 0 and other.stats.chunk_misses == 3


def test_other_model_or_dtype_misses_on_shared_disk_cache(tiny_llama_dir, smol_dir, tmp_path):
    cache = tmp_path / "kv"
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=cache, prefix_tree=False) as first:
        first.warm(PASSAGES)
        first.cache.store.flush()
    other_dir = make_tiny_model(tmp_path / "other", "llama", tokenizer_from=smol_dir, num_hidden_layers=2)
    with Engine.from_pretrained(other_dir, device="cpu", dtype="float32", cache_dir=cache, prefix_tree=False) as other:
        assert other.generate(prompt(), {"max_tokens": 2}).stats.chunk_hits == 0
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="bfloat16", cache_dir=cache, prefix_tree=False) as bf16:
        assert bf16.generate(prompt(), {"max_tokens": 2}).stats.chunk_hits == 0


def test_disk_tier_survives_restart_and_detects_corruption(tiny_llama_dir, tmp_path, caplog):
    cache = tmp_path / "kv"
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=cache, prefix_tree=False) as first:
        assert first.warm(PASSAGES) == 3
        expected = first.generate(prompt(), {"max_tokens": 5}).token_ids
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=cache, prefix_tree=False) as second:
        result = second.generate(prompt(), {"max_tokens": 5})
        assert result.stats.chunk_hits == 3
        assert second.cache.store.hits_disk >= 3
        assert result.token_ids == expected
    files = sorted(cache.glob("*/*.kv.safetensors"))
    assert files
    for path in files:  # flip bytes in the tensor data of every cached file
        data = bytearray(path.read_bytes())
        data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ragcache.store"):
        with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=cache, prefix_tree=False) as third:
            full = third.generate(prompt(), {"max_tokens": 5}, policy="full")
            result = third.generate(prompt(), {"max_tokens": 5})
    assert result.stats.chunk_misses == 3
    # the damaged chunks were computed in place: the answer is full prefill's
    assert result.token_ids == full.token_ids
    assert "damaged" in caplog.text


def test_stream_yields_the_same_text_as_generate(tiny_engine):
    whole = tiny_engine.generate(prompt(), {"max_tokens": 12})
    stream = tiny_engine.stream(prompt(), {"max_tokens": 12})
    assert "".join(stream) == whole.text
    assert stream.result is not None and stream.result.token_ids == whole.token_ids


def test_stop_string_cuts_the_answer(tiny_engine):
    whole = tiny_engine.generate(prompt(), {"max_tokens": 12})
    if len(whole.text) < 4:
        pytest.skip("random model produced too little text")
    stop = whole.text[2:4]
    cut = tiny_engine.generate(prompt(), {"max_tokens": 12, "stop": [stop]})
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and whole.text.startswith(cut.text)


def test_ignore_eos_runs_past_the_models_end_token_but_not_past_stop_ids(tiny_engine):
    """A token of the greedy answer made an end-of-sequence token: the answer stops before it,
    unless ignore_eos, which runs to max_tokens with the same tokens; stop_token_ids still stop."""
    whole = tiny_engine.generate(prompt(), {"max_tokens": 8, "stop_token_ids": []}, policy="full")
    ids = whole.token_ids
    assert len(ids) == 8
    firsts = [i for i in range(1, 8) if ids[i] not in ids[:i]]  # tokens seen there for the first time
    if len(firsts) < 2:
        pytest.skip("random model repeated one token")
    end, stop = firsts[0], firsts[1]
    saved = tiny_engine.eos_ids
    tiny_engine.eos_ids = set(saved) | {ids[end]}
    try:
        ended = tiny_engine.generate(prompt(), {"max_tokens": 8}, policy="full")
        assert ended.finish_reason == "stop" and ended.token_ids == ids[:end]
        ignored = tiny_engine.generate(prompt(), {"max_tokens": 8, "ignore_eos": True}, policy="full")
        assert ignored.finish_reason == "length" and ignored.token_ids == ids
        stopped = tiny_engine.generate(prompt(), {"max_tokens": 8, "ignore_eos": True,
                                                  "stop_token_ids": [ids[stop]]}, policy="full")
        assert stopped.token_ids == ids[:stop]
    finally:
        tiny_engine.eos_ids = saved


def test_background_precompute_turns_misses_into_hits(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                precompute="background", prefix_tree=False) as engine:
        first = engine.generate(prompt(), {"max_tokens": 2})
        assert first.stats.chunk_misses == 3 and first.stats.tokens_computed_fresh == first.stats.prefill_tokens_total
        engine.wait_background()
        assert engine.generate(prompt(), {"max_tokens": 2}).stats.chunk_hits == 3


def test_after_prefix_convention_reuses_first_chunk_exactly(tiny_llama_dir, tmp_path):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                convention="after-prefix", prefix_tree=False) as engine:
        full, _ = engine.prefill_logits(ChunkedPrompt(chunks=PASSAGES[:1], question="Where?"), policy="full")
        engine.warm(PASSAGES[:1])
        reused, stats = engine.prefill_logits(ChunkedPrompt(chunks=PASSAGES[:1], question="Where?"), policy="reuse")
        assert [span["mode"] for span in stats.plan if span["kind"] == "chunk"] == ["exact"]
        assert (full - reused).abs().max().item() <= 1e-4


def test_frequency_order_puts_hot_chunks_first(tiny_engine):
    for _ in range(2):
        tiny_engine.generate(prompt([PASSAGES[2]]), {"max_tokens": 1})
    result = tiny_engine.generate(prompt(PASSAGES), {"max_tokens": 1}, order="frequency")
    chunk_spans = [s for s in result.stats.plan if s["kind"] == "chunk"]
    assert chunk_spans[0]["chunk_id"] == prompt([PASSAGES[2]]).chunks[0].id


def test_access_counts_are_per_tenant(tiny_engine):
    by_id = sorted(prompt(PASSAGES).chunks, key=lambda c: c.id)
    hot = by_id[-1]  # last by id: only its access count could move it first
    for _ in range(3):
        tiny_engine.generate(prompt([hot.text]), {"max_tokens": 1}, tenant="busy")
    busy = tiny_engine.generate(prompt(PASSAGES), {"max_tokens": 1}, order="frequency", tenant="busy")
    quiet = tiny_engine.generate(prompt(PASSAGES), {"max_tokens": 1}, order="frequency", tenant="quiet")
    assert [s["chunk_id"] for s in busy.stats.plan if s["kind"] == "chunk"][0] == hot.id
    # another tenant's traffic does not reorder this one's chunks: equal counts order by id
    assert [s["chunk_id"] for s in quiet.stats.plan if s["kind"] == "chunk"] == [c.id for c in by_id]


@pytest.mark.parametrize(
    "bad,error",
    [
        (dict(chunks=["word " * 2100]), PromptTooLongError),
        (dict(chunks=["word " * 600] * 4), PromptTooLongError),
        (dict(question="   "), InvalidPromptError),
    ],
    ids=["chunk-over-context", "prompt-over-context", "empty-question"],
)
def test_bad_prompts_raise_clear_errors_and_cache_nothing(tiny_engine, bad, error):
    args = {"chunks": PASSAGES[:1], "question": "Why?", **bad}
    with pytest.raises(error) as info:
        tiny_engine.generate(ChunkedPrompt(**args), {"max_tokens": 8})
    assert len(str(info.value).splitlines()) == 1
    tiny_engine.cache.store.flush()
    assert tiny_engine.cache.store.stats().ram_entries == 0
    assert not list((tiny_engine.config.store.cache_dir or tiny_engine.cache.store.disk.directory).rglob("*.tmp"))


@pytest.mark.parametrize("field", ["chunks", "question", "system"])
def test_non_utf8_text_is_rejected_with_a_clear_message(field):
    from pydantic import ValidationError

    args = {"chunks": ["ok"], "question": "Why?", field: ["caf\udce9"] if field == "chunks" else "caf\udce9"}
    with pytest.raises(ValidationError, match="not valid UTF-8"):
        ChunkedPrompt(**args)


def test_chunk_kv_entry_sizes(tiny_engine):
    tiny_engine.warm(PASSAGES[:1])
    entry = next(v for _, v in tiny_engine.cache.store.ram.items() if isinstance(v, ChunkKV) and v.chunk_id)
    c = tiny_engine.runner.config
    assert entry.keys.shape == (c.num_layers, entry.num_tokens, c.num_kv_heads, c.head_dim)


@pytest.mark.parametrize("spec", ["cacheblend:0.3:gradual", "cacheblend:0.15", "focus:0.2", "epic:4", "prefix", "reuse", "full"])
def test_policy_specs_parse_and_run(tiny_engine, spec):
    result = tiny_engine.generate(prompt(), {"max_tokens": 2}, policy=spec)
    assert result.stats.policy == spec.split(":")[0]


@pytest.mark.parametrize("spec", ["cacheblend:2", "cacheblend:x", "epic:-", "nope", "cacheblend:0.2:fast"])
def test_bad_policy_specs_are_clear_errors(tiny_engine, spec):
    with pytest.raises(InvalidPromptError):
        tiny_engine.generate(prompt(), {"max_tokens": 2}, policy=spec)


def test_gradual_filtering_shrinks_over_layers(tiny_engine):
    tiny_engine.warm(PASSAGES)
    tiny_engine.prefill_logits(prompt(), policy="reuse")  # caches the template prefix for both runs below
    _, sharp = tiny_engine.prefill_logits(prompt(), policy="cacheblend:0.2")
    _, gradual = tiny_engine.prefill_logits(prompt(), policy="cacheblend:0.2:gradual")
    assert gradual.tokens_recomputed == sharp.tokens_recomputed  # same final budget
    assert gradual.computed_fraction > sharp.computed_fraction  # more tokens on the middle layers


def test_clear_cache_with_a_tenant_touches_only_that_tenant(tiny_engine):
    for tenant in ("a", "b"):
        assert tiny_engine.warm(PASSAGES, tenant=tenant) == 3
    first = prompt().chunks[0].id
    assert tiny_engine.clear_cache(first, tenant="a") == 1
    assert tiny_engine.warm(PASSAGES, tenant="a") == 1 and tiny_engine.warm(PASSAGES, tenant="b") == 0
    assert tiny_engine.clear_cache(tenant="b") >= 3
    assert tiny_engine.warm(PASSAGES, tenant="a") == 0 and tiny_engine.warm(PASSAGES, tenant="b") == 3


def test_teacher_forced_logits_follow_the_answer_and_ratio_one_equals_full(tiny_engine):
    """Along full prefill's own greedy answer, full's teacher-forced argmax is that answer, and
    cacheblend at ratio 1.0 gives full's logits at every position."""
    answer = tiny_engine.generate(prompt(), {"max_tokens": 6, "stop_token_ids": []}, policy="full").token_ids
    full, _ = tiny_engine.teacher_forced_logits(prompt(), answer[:-1], policy="full")
    assert full.shape[0] == len(answer) and full.argmax(-1).tolist() == answer
    tiny_engine.warm(PASSAGES)
    blended, stats = tiny_engine.teacher_forced_logits(prompt(), answer[:-1], policy="cacheblend:1.0")
    assert stats.chunk_hits == 3
    assert (full - blended).abs().max().item() <= 1e-4
