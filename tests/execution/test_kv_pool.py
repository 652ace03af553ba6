"""Request KV buffers recycled on a CPU: what the pool keeps and hands out, and that requests
served from recycled buffers answer exactly as from fresh ones, one at a time and concurrently."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ragcache_integrations import ChunkedPrompt

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
    "Lake Baikal in Siberia holds about a fifth of the fresh water on the Earth's surface.",
]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from engine_sidecar.model.runner import ModelRunner

    return ModelRunner.load(tiny_llama_dir, device="cpu", dtype="float32")


def _pool(runner, max_bytes=1 << 30, max_buffers=4):
    from engine_sidecar.execution.kv_pool import KVPool

    return KVPool(runner, max_bytes, max_buffers)


def test_a_returned_buffer_is_handed_out_again_as_a_contiguous_view(runner):
    pool = _pool(runner)
    first = pool.take(40)
    address = first.keys.data_ptr()
    pool.give(first)
    assert first.storage is None  # the buffer no longer claims the storage
    again = pool.take(25)
    c = runner.config
    assert again.keys.shape == (c.num_layers, 25, c.num_kv_heads, c.head_dim)
    assert all(t.is_contiguous() for t in (again.keys_pre, again.keys, again.values))
    assert again.keys.data_ptr() == address and pool.reused == 1
    pool.give(again)
    longer = pool.take(60)  # within the headroom a new storage keeps for longer requests
    assert longer.keys.data_ptr() == address and pool.reused == 2
    bigger = pool.take(61)  # nothing kept fits: a new buffer
    assert bigger.keys.data_ptr() != address and pool.reused == 2


def test_the_smallest_storage_that_fits_is_taken(runner):
    pool = _pool(runner)
    small, large = pool.take(10), pool.take(100)
    small_at, large_at = small.keys.data_ptr(), large.keys.data_ptr()
    pool.give(large)
    pool.give(small)
    assert pool.take(8).keys.data_ptr() == small_at
    assert pool.take(8).keys.data_ptr() == large_at


def test_the_pool_keeps_the_largest_buffers_within_its_bounds(runner):
    c = runner.config
    one_row = 3 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # keys before and after RoPE, values; fp32
    pool = _pool(runner, max_buffers=2)
    # storages are 1.5x their first request: 150 + 45 rows kept, 150 + 90 would pass the bound
    pool.max_bytes = 200 * one_row
    for kv in [pool.take(rows) for rows in (10, 100, 30, 60)]:
        pool.give(kv)
    assert pool.held_bytes == (150 + 45) * one_row
    assert len(pool._free) == 2


def test_a_buffer_grown_by_decode_is_not_taken_back(runner):
    pool = _pool(runner)
    kv = pool.take(4)
    kv.ensure_capacity(9)  # new, larger tensors: the pooled storage is no longer theirs
    pool.give(kv)
    assert pool.held_bytes == 0


def _answers(engine, prompts, concurrent=False):
    def ask(prompt):
        return engine.generate(prompt, GREEDY, policy="cacheblend").token_ids

    if not concurrent:
        return [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as clients:
        return list(clients.map(ask, prompts))


def test_recycled_buffers_answer_as_fresh_ones(tiny_llama_dir, tmp_path):
    """Prompts of different lengths, answered with fresh buffers, then again from recycled ones
    (one at a time, then all at once, where four running sequences must never share one): the
    same tokens every time."""
    from engine_sidecar import Engine

    prompts = [ChunkedPrompt(chunks=PASSAGES[: i + 1][::-1], question=f"Which is the largest? ({i})")
               for i in range(4)]
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", disk=False,
                                cache_dir=tmp_path / "a", prefix_tree=False) as engine:
        assert engine.kv_pool is not None
        engine.warm(PASSAGES)
        engine.steps.kv_pool = None  # fresh buffers only
        fresh = _answers(engine, prompts)
        engine.steps.kv_pool = engine.kv_pool
        pooled = _answers(engine, prompts[::-1])[::-1]  # longest first: each next one fits the last's
        reused_one_by_one = engine.kv_pool.reused
        concurrent = _answers(engine, prompts, concurrent=True)
        again = _answers(engine, prompts[::-1])[::-1]
    assert reused_one_by_one >= 3 and engine.kv_pool.reused > reused_one_by_one
    assert pooled == fresh and concurrent == fresh and again == fresh


def test_probes_recycle_buffers_and_give_the_same_logits(tiny_llama_dir, tmp_path):
    """The fidelity probes (and the full-prefill baseline they are compared with) take their
    buffers from the pool as requests do, and give them back: the logits are those of fresh
    buffers."""
    from engine_sidecar import Engine

    prompt = ChunkedPrompt(chunks=PASSAGES[::-1], question="Which river is the longest?")
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", disk=False,
                                cache_dir=tmp_path, prefix_tree=False) as engine:
        engine.warm(PASSAGES)
        pool, engine.probes.kv_pool, engine.probes._allocate = engine.kv_pool, None, None
        engine.teacher_forced_logits(prompt, [5, 6, 7], policy="cacheblend")  # its first run stores the prefix
        fresh, _ = engine.teacher_forced_logits(prompt, [5, 6, 7], policy="cacheblend")
        engine.probes.kv_pool, engine.probes._allocate = pool, pool.take
        engine.measure_full_prefill(prompt)
        first, _ = engine.teacher_forced_logits(prompt, [5, 6, 7], policy="cacheblend")
        second, _ = engine.teacher_forced_logits(prompt, [5, 6, 7], policy="cacheblend")
    assert pool.reused >= 2
    assert torch.equal(first, fresh) and torch.equal(second, fresh)
