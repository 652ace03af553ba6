"""Fidelity diagnostics in `ragcache bench fidelity`: the oracle selection (bench only), the
per-layer divergence report and the fp32/bf16 noise floor."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from engine_sidecar.calibrate.reference import capture_last_hidden, full_pass, prefill_hidden
from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import PrefillView, parse_policy
from engine_sidecar.store.entry import ChunkKV
from ragcache_integrations.types import ChunkedPrompt
from ragcache_lab.divergence import layer_divergence
from ragcache_lab.oracle_policy import OraclePolicy, kv_deviation
from ragcache_lab.policy_specs import fidelity_policy_list_arg, oracle_ratio

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]
PROMPT = ChunkedPrompt(chunks=PASSAGES, question="Which river reaches the Atlantic?")


def test_oracle_spec_is_a_bench_policy_only():
    assert oracle_ratio("oracle:0.15") == 0.15
    assert fidelity_policy_list_arg("full,reuse,oracle:0.15,cacheblend:0.3") == "full,reuse,oracle:0.15,cacheblend:0.3"
    for bad in ("oracle:1.5", "oracle:x", "oracle", "nosuch:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            fidelity_policy_list_arg(bad)
    with pytest.raises(InvalidPromptError):  # the engine's own parser (server API, CLI --policy) refuses it
        parse_policy("oracle:0.15")


def _plan_with_one_fused_chunk(cached_keys, cached_values) -> FusionPlan:
    n = cached_keys.shape[1]
    cached = ChunkKV(cached_keys, cached_values, torch.arange(n))
    return FusionPlan([PlanSpan("prefix", 0, (1, 2), "fresh"), PlanSpan("chunk", 2, tuple(range(n)), "fuse", cached),
                       PlanSpan("question", 2 + n, (3,), "fresh")], "oracle")


def test_kv_deviation_ranks_by_hand_computed_error_normalized_per_layer():
    layers, n, heads, dim = 2, 4, 1, 2
    full_k = torch.ones(layers, n + 3, heads, dim)
    full_v = torch.ones(layers, n + 3, heads, dim)
    full_v[1] *= 10.0  # layer 1's values are large: its errors count relative to that
    cached_k = full_k[:, 2 : 2 + n].clone()
    cached_v = full_v[:, 2 : 2 + n].clone()
    cached_k[0, 1] += 1.0  # token 1: key error 2 on layer 0, whose mean |k|^2 is 2 -> 1.0
    cached_v[1, 2] += 3.0  # token 2: value error 18 on layer 1, mean |v|^2 200 -> 0.09
    cached_v[0, 3] += 2.0  # token 3: value error 8 on layer 0, mean |v|^2 2 -> 4.0
    plan = _plan_with_one_fused_chunk(cached_k, cached_v)
    scores = kv_deviation(plan, full_k, full_v)
    assert scores[:2].isinf().all() and scores[-1].isinf()  # only fused tokens are candidates
    assert torch.allclose(scores[2:6], torch.tensor([0.0, 1.0, 0.09, 4.0]))
    view = PrefillView(None, plan)  # type: ignore[arg-type]  # the oracle runs no model
    selection = OraclePolicy(0.5, full_k, full_v).select(view)
    # the two fresh spans, then the top half of the chunk by deviation: tokens 3 and 1
    assert selection.initial.nonzero().squeeze(1).tolist() == [0, 1, 3, 5, 6]
    assert selection.decided == {"head_share": 1.0} and selection.fixed
    assert OraclePolicy(0.0, full_k, full_v).select(view).initial.nonzero().squeeze(1).tolist() == [0, 1, 6]


def test_oracle_at_ratio_one_is_full_prefill_and_at_zero_is_reuse(tiny_engine):
    ids = tiny_engine.builder.build(PROMPT).token_ids
    ref = full_pass(tiny_engine.runner, ids, 6, set())
    answer = ref["token_ids"]
    assert len(answer) == 6
    tiny_engine.warm(PASSAGES)
    whole, stats = tiny_engine.teacher_forced_logits(PROMPT, answer[:-1],
                                                     policy=OraclePolicy(1.0, ref["keys_pre"], ref["values"]))
    assert stats.chunk_hits == 3
    assert (whole - ref["logits"]).abs().max().item() <= 1e-4
    none, _ = tiny_engine.teacher_forced_logits(PROMPT, answer[:-1],
                                                policy=OraclePolicy(0.0, ref["keys_pre"], ref["values"]))
    reuse, _ = tiny_engine.teacher_forced_logits(PROMPT, answer[:-1], policy="reuse")
    assert torch.allclose(none, reuse, atol=1e-6)
    assert (none - ref["logits"]).abs().max().item() > 1e-3  # reuse does differ on this model


def test_full_pass_is_the_engines_full_generation(tiny_engine):
    """The bench's own full prefill + greedy decode gives what engine.generate(policy='full') does."""
    result = tiny_engine.generate(PROMPT, {"max_tokens": 8}, policy="full")
    ref = full_pass(tiny_engine.runner, tiny_engine.builder.build(PROMPT).token_ids, 8, tiny_engine.eos_ids)
    assert ref["token_ids"] == result.token_ids
    assert tiny_engine.builder.decode(ref["token_ids"]) == result.text
    assert ref["logits"].shape[0] == len(result.token_ids)
    assert ref["logits"].argmax(-1).tolist() == result.token_ids
    assert ref["hidden"].shape == (tiny_engine.runner.num_layers, tiny_engine.runner.config.hidden_size)


def test_capture_keeps_only_this_threads_calls_and_restores_the_runner(tiny_engine):
    runner = tiny_engine.runner
    hidden = runner.embed(torch.tensor([5, 6, 7]))
    with capture_last_hidden(runner) as rows:
        out = runner.mlp(0, hidden)
        other = threading.Thread(target=lambda: runner.mlp(1, hidden))
        other.start()
        other.join()
    assert len(rows) == 1 and torch.equal(rows[0], out[-1].float())
    assert "mlp" not in vars(runner)  # the class's method is back
    with pytest.raises(AssertionError):
        prefill_hidden(rows, runner.num_layers)


def test_layer_divergence_is_zero_for_identical_states_and_scales():
    ref = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    same = layer_divergence(ref.clone(), ref)
    assert same == {"cosine_distance": [0.0, 0.0], "relative_l2": [0.0, 0.0]}
    other = layer_divergence(torch.tensor([[3.0, 4.0], [0.0, 1.0]]) * torch.tensor([[2.0], [1.0]]), ref)
    assert other["relative_l2"] == pytest.approx([1.0, 2**0.5])
    assert other["cosine_distance"] == pytest.approx([0.0, 1.0])


def test_bench_reports_divergence_oracle_and_noise_floor(tiny_llama_dir, tmp_path):
    out = tmp_path / "diag.json"
    proc = subprocess.run(
        [sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", "--data", "fanoutqa", "--n", "3", "--k", "3",
         "--policies", "full,reuse,cacheblend:0.15,oracle:0.15,oracle:1.0", "--model", str(tiny_llama_dir),
         "--no-transformers", "--no-disk", "--chunk-kv", "precomputed", "--max-tokens", "4", "--noise-floor", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    summary = result["policies"]
    assert list(summary) == ["full", "reuse", "cacheblend:0.15", "oracle:0.15", "oracle:1.0", "full@bf16"]
    layers = len(summary["full"]["divergence"]["relative_l2"])
    assert layers == 3
    # full against itself: nothing diverges; the oracle at 1.0 recomputes every fused token
    assert summary["full"]["divergence"]["relative_l2"] == [0.0] * layers
    assert summary["oracle:1.0"]["tf_agreement"] == 1.0
    assert max(summary["oracle:1.0"]["divergence"]["relative_l2"]) < 1e-4
    assert summary["oracle:1.0"]["recompute_share"] > summary["oracle:0.15"]["recompute_share"] > 0.0
    # reuse: layer 0's KV is position-free and exact; past it the last token drifts away from full's
    reuse = summary["reuse"]["divergence"]["relative_l2"]
    assert reuse[0] < 1e-5 and reuse[-1] > 1e-3 and reuse[-1] >= reuse[1]
    # the noise floor: full in bf16, compared with fp32 full along its answer
    noise = summary["full@bf16"]
    assert result["config"]["noise_floor"] == "full@bf16"
    assert 0.0 <= noise["tf_agreement"] <= 1.0 and 0.0 < max(noise["divergence"]["relative_l2"]) < 0.2
    # rows are also kept one per line as questions finish (a run stopped early keeps them)
    partial = [json.loads(line) for line in out.with_suffix(".partial.jsonl").read_text().splitlines()]
    assert [r["question"] for r in partial] == [r["question"] for r in result["rows"]]
    md = out.with_suffix(".md").read_text()
    assert "Per-layer divergence" in md and "| full@bf16 |" in md and "of its picks sit in the first 16" in md


def _fidelity_follow_up(model_dir, n: str, policies: str) -> subprocess.CompletedProcess:
    """`ragcache bench fidelity --follow-up` on the tiny model, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", "--data", "fanoutqa", "--n", n, "--k", "3",
         "--policies", policies, "--model", str(model_dir), "--no-transformers", "--no-disk",
         "--max-tokens", "2", "--follow-up"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})


def test_oracle_and_noise_floor_refuse_follow_up(tiny_llama_dir):
    proc = _fidelity_follow_up(tiny_llama_dir, "2", "full,oracle:0.15")
    assert proc.returncode != 0 and "follow-up" in proc.stderr


def test_follow_up_with_one_question_is_one_line_error(tiny_llama_dir):
    proc = _fidelity_follow_up(tiny_llama_dir, "1", "full,reuse")
    assert proc.returncode != 0 and "at least two questions" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
