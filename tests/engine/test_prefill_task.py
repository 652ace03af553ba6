"""A prefill run a few layers at a time (what the scheduler does while other requests decode):
the same logits as run whole, a damaged disk file still retried from a new plan part-way, and a
prefill stopped part-way leaves no disk read writing into its buffer."""

from __future__ import annotations

import threading

import pytest
import torch

from engine_sidecar import Engine
from engine_sidecar.execution.policies import parse_policy
from ragcache_integrations.types import ChunkedPrompt
from tests.execution.test_prefetch import PASSAGES, PROMPT, cold_engine


def _planned(engine: Engine, policy: str):
    return engine.cache.plan(ChunkedPrompt.model_validate(PROMPT), parse_policy(policy), "")


def _in_parts(engine: Engine, planned, budget: int):
    times: dict[str, float] = {}
    task = engine.prefill_stage.start(planned, planned.plan.num_tokens + 1, times)
    parts = 0
    while task.result is None:
        assert task.advance(budget) > 0
        parts += 1
    return task, parts, times


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ragcache-prefetch" and t.is_alive()]


@pytest.fixture
def warmed(tiny_llama_dir, tmp_path):
    cache = tmp_path / "kv"
    with cold_engine(tiny_llama_dir, cache, True) as warm:
        warm.warm(PASSAGES)
        warm.cache.store.flush()
    return cache


@pytest.mark.parametrize("policy", ["full", "cacheblend"])
def test_a_prefill_in_parts_gives_the_logits_of_one_run_whole(tiny_llama_dir, warmed, policy):
    with cold_engine(tiny_llama_dir, warmed, True) as engine:
        whole = engine.prefill_stage.run(_planned(engine, policy), 200, {})[1].logits
    with cold_engine(tiny_llama_dir, warmed, True) as engine:  # cold again: the disk read layer by layer
        task, parts, times = _in_parts(engine, _planned(engine, policy), budget=1)
        assert parts == engine.runner.num_layers  # a budget of one token-layer: one layer a call
        assert task.result is not None and times["prefill_s"] > 0
        assert torch.allclose(task.result.logits, whole, atol=1e-5)


def test_a_prefill_stopped_part_way_waits_for_its_disk_reads(tiny_llama_dir, warmed):
    with cold_engine(tiny_llama_dir, warmed, True) as engine:
        planned = _planned(engine, "cacheblend")
        task = engine.prefill_stage.start(planned, planned.plan.num_tokens + 1, {})
        task.advance(1)
        assert task.result is None
        task.close()
        assert not _prefetch_threads()
        # the engine goes on serving
        assert engine.generate(PROMPT, {"max_tokens": 2}, policy="cacheblend").token_ids


def test_a_file_found_damaged_part_way_is_replanned_as_a_miss(tiny_llama_dir, warmed):
    with cold_engine(tiny_llama_dir, warmed, True) as engine:
        expected = engine.prefill_stage.run(_planned(engine, "full"), 200, {})[1].logits
    for path in sorted(warmed.glob("*/*.kv.safetensors")):
        data = bytearray(path.read_bytes())
        data[-32:] = bytes(b ^ 0xFF for b in data[-32:])
        path.write_bytes(bytes(data))
    with cold_engine(tiny_llama_dir, warmed, True) as engine:
        task, _, _ = _in_parts(engine, _planned(engine, "cacheblend:1.0"), budget=1)
        assert task.retried
        assert all(span.cached is None for span in task.planned.plan.spans if span.kind == "chunk")
        assert task.result is not None and torch.allclose(task.result.logits, expected, atol=1e-5)
