"""An engine whose running requests keep their KV in the block pool (`kv_block_size`): the same
greedy answers as buffers of their own, admission by free blocks, every block back when requests
end however they end, a request the pool can never hold refused up front, and conversations that
continue from a history rebuilt out of the pool."""

from __future__ import annotations

import time

import pytest

from engine_sidecar import Engine
from engine_sidecar.errors import PromptTooLongError
from engine_sidecar.execution.policies import parse_policy
from ragcache_integrations.policy_registry import DEFAULT_POLICY
from ragcache_integrations.types import ChunkedPrompt
from tests.engine.test_scheduler import concurrently

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompt(i: int, conversation_id: str | None = None) -> ChunkedPrompt:
    return ChunkedPrompt(chunks=[PASSAGES[i % 3], PASSAGES[(i + 1) % 3]], question=f"Which one, number {i}?",
                         conversation_id=conversation_id)


def _engine(model_dir, **options) -> Engine:
    return Engine.from_pretrained(model_dir, device="cpu", dtype="float32", disk=False, **options)


def _all_blocks_back(engine: Engine) -> bool:
    """Whether every block is back in the pool: a request's result is posted just before the
    scheduler lets go of its blocks, so the caller may look a moment early."""
    assert engine.blocks is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if engine.blocks.free_blocks == engine.blocks.num_blocks and engine.stats().kv_rows.blocks_used == 0:
            return True
        time.sleep(0.01)
    return False


def _answers(engine: Engine, n: int = 4) -> list[list[int]]:
    results = concurrently(lambda i: engine.generate(_prompt(i), {**GREEDY, "max_tokens": 10 + 7 * i}), n)
    return [r.token_ids for r in results]


def test_paged_answers_equal_buffered_ones_and_every_block_comes_back(smol_dir):
    """The real SmolLM2: each request alone answers from blocks what it answers from a buffer
    (alone, so both run the same batch of one: which requests share a step changes the rounding,
    and greedy near-ties with it; mixed batches are compared logit by logit in
    tests/execution/test_paged_decode.py). Decoded together from blocks, every request finishes
    and every block comes back."""
    sampling = [{**GREEDY, "max_tokens": 10 + 7 * i} for i in range(4)]
    with _engine(smol_dir) as buffered:
        expected = [buffered.generate(_prompt(i), sampling[i]).token_ids for i in range(4)]
    with _engine(smol_dir, kv_block_size=16) as paged:
        assert paged.blocks is not None
        assert [paged.generate(_prompt(i), sampling[i]).token_ids for i in range(4)] == expected
        together = _answers(paged)
        assert [len(t) for t in together] == [len(t) for t in expected]
        assert paged.stats().peak_batch > 1, "no decode step served more than one paged sequence"
        rows = paged.stats().kv_rows
        assert rows.blocks_total == paged.blocks.num_blocks
        assert rows.peak_blocks_used >= 2
        assert _all_blocks_back(paged)


def _pool_engine(smol_dir, blocks: int, block_size: int = 8) -> Engine:
    with _engine(smol_dir, kv_block_size=block_size) as probe:
        assert probe.blocks is not None
        block_bytes = probe.blocks.bytes_per_block
    return _engine(smol_dir, kv_block_size=block_size, batch_kv_bytes=block_bytes * blocks)


@pytest.mark.parametrize("policy", ["full", DEFAULT_POLICY])
def test_a_pool_too_small_for_every_answer_preempts_and_recomputes(smol_dir, policy):
    """Three requests admitted by the rows they hold now, in a pool with room for two prompts and
    a few blocks to spare but not for two whole answers: two run together, run out of blocks as
    they grow, the newest is preempted (its blocks freed, queued first again, its prompt and
    answer so far recomputed when it is let back in), and all three finish, none with an error.
    Under `full` each answer is the one it gets alone."""
    sampling = {**GREEDY, "max_tokens": 60}
    with _engine(smol_dir, kv_block_size=8) as probe:
        alone = [probe.generate(_prompt(i), sampling, policy=policy).token_ids for i in range(3)]
        assert probe.blocks is not None
        prompts = [probe.cache.plan(_prompt(i), parse_policy(policy), "").plan.num_tokens for i in range(3)]
        prompt_blocks = max(probe.blocks.blocks_for(n + 1) for n in prompts)
        whole = max(probe.blocks.blocks_for(n + 61) for n in prompts)
    pool = 2 * prompt_blocks + 6  # two prompts with their spare blocks, however the arrivals fall
    assert whole <= pool < 2 * whole
    with _pool_engine(smol_dir, pool) as small:
        results = concurrently(lambda i: small.generate(_prompt(i), sampling, policy=policy), 3)
        assert all(len(r.token_ids) == 60 for r in results)
        if policy == "full":
            assert [r.token_ids for r in results] == alone
        stats = small.stats()
        assert stats.peak_batch >= 2 and stats.preemptions >= 1
        assert stats.kv_rows.peak_blocks_used <= pool
        assert _all_blocks_back(small)


def test_a_request_the_pool_can_never_hold_is_refused_up_front(tiny_llama_dir):
    with _engine(tiny_llama_dir, kv_block_size=16, batch_kv_bytes=1 << 20) as engine:
        assert engine.blocks is not None
        too_many = engine.blocks.num_blocks * engine.blocks.block_size
        with pytest.raises(PromptTooLongError, match="--batch-kv-gb"):
            engine.generate(_prompt(0), {**GREEDY, "max_tokens": too_many})
        assert engine.generate(_prompt(0), {**GREEDY, "max_tokens": 4}).token_ids
        assert _all_blocks_back(engine)


def test_a_closed_stream_gives_its_blocks_back(tiny_llama_dir):
    with _engine(tiny_llama_dir, kv_block_size=16) as engine:
        assert engine.blocks is not None
        stream = engine.stream(_prompt(0), {**GREEDY, "max_tokens": 400})
        ticks = stream.ticks()
        next(ticks)  # the first token is out before its KV moves into the pool: read one more
        next(ticks)
        assert engine.blocks.free_blocks < engine.blocks.num_blocks
        stream.close()
        other = engine.generate(_prompt(1), {**GREEDY, "max_tokens": 4})  # a step runs: the closed one leaves
        assert len(other.token_ids) == 4
        assert _all_blocks_back(engine)


def test_a_conversation_continues_from_a_history_rebuilt_out_of_the_pool(smol_dir):
    def two_turns(engine: Engine) -> tuple[list[int], list[dict]]:
        engine.generate(_prompt(0, "conv"), {**GREEDY, "max_tokens": 9})
        follow = engine.generate(ChunkedPrompt(chunks=[PASSAGES[2]], question="And the longest?",
                                               conversation_id="conv"), {**GREEDY, "max_tokens": 12})
        return follow.token_ids, follow.stats.plan

    with _engine(smol_dir) as buffered:
        expected, _ = two_turns(buffered)
    with _engine(smol_dir, kv_block_size=16) as paged:
        answer, plan = two_turns(paged)
        assert plan[0]["kind"] == "history" and plan[0]["mode"] == "exact"
        assert answer == expected
        assert _all_blocks_back(paged)


def test_a_pool_smaller_than_one_block_is_a_settings_error(tiny_llama_dir):
    from engine_sidecar.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError, match="--batch-kv-gb of at least one block"):
        _engine(tiny_llama_dir, kv_block_size=16, batch_kv_bytes=0)
