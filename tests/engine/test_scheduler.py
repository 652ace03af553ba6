"""Batched serving: decode steps over several sequences at once, admission limits, cancellation,
and greedy answers that do not depend on what else is running."""

from __future__ import annotations

import threading

import pytest

from engine_sidecar import Engine
from engine_sidecar.model.runner import ModelRunner
from ragcache_integrations.policy_registry import DEFAULT_POLICY
from tests.conftest import assert_batched_decode_matches_forward, make_tiny_model

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
    "Lake Baikal in Siberia holds about a fifth of the fresh surface water on Earth.",
]
QUESTIONS = ["Which river reaches the Atlantic?", "How high is Kilimanjaro?", "How many countries does the Danube cross?",
             "Where is Lake Baikal?", "Which is the highest mountain in Africa?", "What does Lake Baikal hold?"]


@pytest.mark.parametrize("model_type,extra,dtype,tol", [
    ("llama", {}, "float32", 1e-4),
    ("mistral", {"sliding_window": 7}, "float32", 1e-4),
    # bf16 decode attention takes another matmul order with scores rounded to bf16 once (the
    # reference is the same runner's bf16 forward through SDPA); logits here are ~0.5 in size
    ("llama", {}, "bfloat16", 1e-2),
])
def test_batched_decode_equals_full_forward_of_each_sequence(tmp_path, model_type, extra, dtype, tol):
    """Three sequences of different lengths decoded together, token by token, give the logits a
    full forward of each extended sequence gives (with a sliding window exceeded too)."""
    runner = ModelRunner.load(make_tiny_model(tmp_path / model_type, model_type, **extra), device="cpu",
                              dtype=dtype)
    assert_batched_decode_matches_forward(runner, tol)


@pytest.fixture(scope="module")
def smol_engine(smol_dir, tmp_path_factory):
    engine = Engine.from_pretrained(smol_dir, device="cpu", dtype="float32", disk=False)
    yield engine
    engine.close()


def _prompt(i: int) -> dict:
    return {"chunks": [PASSAGES[i % 4], PASSAGES[(i + 1) % 4]], "question": QUESTIONS[i % len(QUESTIONS)]}


def concurrently(fn, n: int) -> list:
    results: list = [None] * n
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        results[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


@pytest.mark.parametrize("policy", ["full", "cacheblend"])
def test_greedy_answers_under_concurrency_equal_sequential_ones(smol_engine, policy):
    """The real SmolLM2: six requests at once are batched (a decode step serves several) and
    each answers token for token what it answers alone."""
    n = 6
    alone = [smol_engine.generate(_prompt(i), {"max_tokens": 12}, policy=policy).token_ids for i in range(n)]
    steps, served = smol_engine.scheduler.steps_decode, smol_engine.scheduler.decode_batch_sum
    together = concurrently(lambda i: smol_engine.generate(_prompt(i), {"max_tokens": 12}, policy=policy), n)
    assert [r.token_ids for r in together] == alone
    assert smol_engine.scheduler.decode_batch_sum - served > smol_engine.scheduler.steps_decode - steps, \
        "no decode step served more than one sequence"
    assert all(r.stats.stage_times["queue_s"] >= 0 for r in together)


def test_max_batch_and_kv_budget_bound_the_running_set(tiny_llama_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", disk=False, max_batch=2)
    try:
        concurrently(lambda i: engine.generate(_prompt(i), {"max_tokens": 16}, policy="full"), 5)
        assert engine.scheduler.peak_batch == 2
    finally:
        engine.close()
    # a budget below one sequence's KV: each runs alone (still runs: nothing would otherwise)
    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", disk=False, batch_kv_bytes=1)
    try:
        results = concurrently(lambda i: engine.generate(_prompt(i), {"max_tokens": 8}, policy="full"), 3)
        assert all(r.token_ids for r in results)
        assert engine.scheduler.peak_batch == 1
    finally:
        engine.close()


def test_a_closed_stream_leaves_the_batch_and_others_finish(tiny_engine):
    stream = tiny_engine.stream(_prompt(0), {"max_tokens": 400, "stop_token_ids": []}, policy="full")
    ticks = stream.ticks()
    next(ticks)
    other = tiny_engine.generate(_prompt(1), {"max_tokens": 6}, policy="full")
    stream.close()
    assert stream.result is None
    after = tiny_engine.generate(_prompt(2), {"max_tokens": 6}, policy="full")
    assert len(other.token_ids) <= 6 and after.finish_reason in ("length", "stop")
    assert tiny_engine.scheduler.running == 0 and tiny_engine.scheduler.waiting == 0


@pytest.mark.parametrize("policy", ["full", DEFAULT_POLICY])
def test_a_prefill_split_between_decode_steps_answers_as_it_does_whole(smol_dir, policy):
    """With a prefill budget of 16 tokens (x 30 layers) a request arriving while another decodes
    has its prefill paused between layers for that one's decode steps: its answer is the one the
    same request gets prefilled whole, when nothing else runs."""
    with Engine.from_pretrained(smol_dir, device="cpu", dtype="float32", disk=False,
                                prefill_token_budget=16) as engine:
        question = _prompt(1)
        engine.generate(question, {"max_tokens": 8}, policy=policy)  # its chunks are now cached
        whole = engine.generate(question, {"max_tokens": 8}, policy=policy)
        assert engine.scheduler.prefill_splits == 0  # nothing was decoding: prefilled whole
        stream = engine.stream(_prompt(0), {"max_tokens": 80, "ignore_eos": True}, policy="full")
        ticks = stream.ticks()
        next(ticks)  # the other request is decoding now
        split = engine.generate(question, {"max_tokens": 8}, policy=policy)
        assert engine.scheduler.prefill_splits > 0
        assert split.token_ids == whole.token_ids
        assert split.stats.stage_times["prefill_s"] > 0
        assert len(list(ticks)) == 79
