"""`tempT` (APE-style attention temperature on the reused chunk KV): the grammar, the
effect computed a second way (the same prefill over cached keys scaled by 1/T), the layer-wise
loading path, recomputed rows untouched, and the ratio-1.0 guard."""

from __future__ import annotations

import pytest
import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.fused_temperature import temper_stale_rows
from engine_sidecar.execution.policies import parse_policy
from ragcache_integrations import ChunkedPrompt
from ragcache_integrations.policy_registry import PolicySpecError, parse_policy_spec
from tests.execution.test_prefetch import cold_engine
from tests.policy_prompt import PASSAGES, QUESTION, plan_of


def test_grammar():
    assert parse_policy_spec("cacheblend:0.15:temp1.1").temperature == pytest.approx(1.1)
    assert parse_policy_spec("reuse:temp0.9").temperature == pytest.approx(0.9)
    assert parse_policy_spec("prophet:0.15:nowindow:probe8:temp1.2").probe_layers == 8
    assert parse_policy_spec("cacheblend:0.15:temp2").value == 0.15
    assert parse_policy_spec("cacheblend:0.15").temperature is None
    assert parse_policy("epic:16:temp1.25").temperature == pytest.approx(1.25)
    assert parse_policy("cacheblend").temperature == 1.0
    for bad in ("full:temp1.1", "prefix:temp1.1", "cacheblend:0.15:temp0", "cacheblend:0.15:temp-1",
                "cacheblend:0.15:tempx", "cacheblend:0.15:temp1:temp2", "cacheblend:0.15:tempnan", "reuse:0.5"):
        with pytest.raises(PolicySpecError):
            parse_policy_spec(bad)
        with pytest.raises(InvalidPromptError):
            parse_policy(bad)


def test_temperature_is_attention_over_keys_scaled_by_one_over_t(tiny_engine):
    """reuse:temp2 equals plain reuse over the fused chunks' cached keys halved (RoPE is linear),
    and differs from plain reuse."""
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    tiny_engine.warm(PASSAGES)
    runner = tiny_engine.runner
    plan = plan_of(tiny_engine, prompt, "reuse")
    assert sum(span.mode == "fuse" for span in plan.spans) == 3
    tempered = fused_prefill(runner, plan, parse_policy("reuse:temp2")).logits
    plain = fused_prefill(runner, plan, parse_policy("reuse")).logits
    for span in plan.spans:
        if span.mode == "fuse":
            span.cached.keys = span.cached.keys * 0.5  # a copy: the store's entry is left as it was
    by_hand = fused_prefill(runner, plan, parse_policy("reuse")).logits
    assert torch.allclose(tempered, by_hand, atol=1e-5)
    assert (tempered - plain).abs().max().item() > 1e-3


def test_temper_stale_rows_by_hand():
    keys = torch.ones(6, 1, 2)
    fused = torch.tensor([False, True, True, True, False, False])
    temper_stale_rows(keys, fused, torch.tensor([2, 5]), 0.5)
    assert keys[:, 0, 0].tolist() == [1.0, 0.5, 1.0, 0.5, 1.0, 1.0]
    temper_stale_rows(keys, fused, torch.tensor([2, 5]), None)
    assert keys[:, 0, 0].tolist() == [1.0, 0.5, 1.0, 0.5, 1.0, 1.0]


def test_layerwise_loading_tempers_as_the_in_memory_path(tiny_llama_dir, tmp_path):
    """Chunks read from disk layer by layer during the prefill get the same temperature."""
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    cache = tmp_path / "kv"
    with cold_engine(tiny_llama_dir, cache, True) as warm:
        warm.warm(PASSAGES)
        warm.cache.store.flush()
    with cold_engine(tiny_llama_dir, cache, False) as sync:
        expected, stats = sync.prefill_logits(prompt, policy="cacheblend:0.2:temp1.5")
        plain, _ = sync.prefill_logits(prompt, policy="cacheblend:0.2")
    with cold_engine(tiny_llama_dir, cache, True) as lazy:
        result = lazy.generate(prompt, {"max_tokens": 1}, policy="cacheblend:0.2:temp1.5")
        assert result.stats.stage_times["prefetch_read_s"] > 0
    with cold_engine(tiny_llama_dir, cache, True) as lazy:
        logits, lazy_stats = lazy.prefill_logits(prompt, policy="cacheblend:0.2:temp1.5")
    assert stats.chunk_hits == lazy_stats.chunk_hits == 3
    assert torch.allclose(logits, expected, atol=1e-5)
    assert (expected - plain).abs().max().item() > 1e-4


@pytest.mark.parametrize("spec", ["cacheblend:1.0:temp1.5", "prophet:1.0:temp0.8"])
def test_ratio_one_equals_full_prefill_whatever_the_temperature(tiny_engine, spec):
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    full, _ = tiny_engine.prefill_logits(prompt, policy="full")
    tiny_engine.warm(PASSAGES)
    one, stats = tiny_engine.prefill_logits(prompt, policy=spec)
    assert stats.chunk_hits == 3
    assert (full - one).abs().max().item() <= 1e-4
