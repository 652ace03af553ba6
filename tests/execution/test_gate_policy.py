"""gate: the confidence-gated budget. The probe's first-token prediction is reuse's (its margin
equals that of a real `reuse` prefill), the decision follows the threshold (0: always plain
reuse, logits identical to `reuse`; above 1: always prophet's selection at the same ratio), the
probe's cost is counted either way, ratio 1.0 is full prefill, and the grammar in the API."""

from __future__ import annotations

import math

import pytest
import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.policies import GatePolicy, PrefillView, ProphetPolicy, parse_policy, span_masks
from engine_sidecar.execution.question_probe import first_token_margin, probe
from ragcache_integrations.policy_registry import PolicySpecError, parse_policy_spec
from tests.policy_prompt import PASSAGES, PROMPT, QUESTION


def _warm(engine) -> None:
    """Chunks cached, and the template prefix too (the first request computes it, later ones
    reuse it exactly): every request after this one has the same plan."""
    engine.warm(PASSAGES)
    engine.prefill_logits(PROMPT, policy="reuse")


def _plan(engine, policy):
    prompt, _, pol = engine.prep.prepare(PROMPT, None, policy, "preserve", "")
    return engine.cache.plan(prompt, pol, "").plan


def _spans(stats) -> tuple[int, int]:
    """(fused, fresh) token counts of a request's plan."""
    spans = [(s["positions"][1] - s["positions"][0], s["mode"]) for s in stats.plan]
    return sum(n for n, m in spans if m == "fuse"), sum(n for n, m in spans if m == "fresh")


def test_first_token_margin_by_hand():
    # probabilities [0.5, 0.3, 0.2]: margin 0.2
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert abs(first_token_margin(logits) - 0.2) < 1e-6
    assert first_token_margin(torch.zeros(4)) == 0.0


def test_ratio_one_equals_full_prefill(tiny_engine):
    full, _ = tiny_engine.prefill_logits(PROMPT, policy="full")
    answer = [int(full.argmax()), 11, 42, 7]
    full_tf, _ = tiny_engine.teacher_forced_logits(PROMPT, answer, policy="full")
    tiny_engine.warm(PASSAGES)
    gate = GatePolicy(1.0)
    one, stats = tiny_engine.prefill_logits(PROMPT, policy=gate)
    # no probe ran
    decided = stats.policy_decisions
    assert stats.chunk_hits == 3 and decided["escalated"] and decided["margin"] is None
    assert decided["probe_token_layers"] == 0 and decided["selected"] == stats.tokens_recomputed > 0
    assert (full - one).abs().max().item() <= 1e-4
    one_tf, _ = tiny_engine.teacher_forced_logits(PROMPT, answer, policy="gate:1.0")
    assert torch.equal(one_tf.argmax(-1), full_tf.argmax(-1))
    assert (one_tf - full_tf).abs().max().item() <= 1e-4


def test_the_probes_prediction_is_reuses_first_token(tiny_engine):
    _warm(tiny_engine)
    reuse, _ = tiny_engine.prefill_logits(PROMPT, policy="reuse")
    result = probe(tiny_engine.runner, _plan(tiny_engine, "reuse"), logits=True)
    assert result.logits is not None and (result.logits - reuse).abs().max().item() <= 1e-5
    _, stats = tiny_engine.prefill_logits(PROMPT, policy=GatePolicy(0.3))
    margin = first_token_margin(reuse)
    # the tiny random model is nearly uniform over its vocabulary: margins are small, so relative
    assert margin > 0 and abs(stats.policy_decisions["margin"] - margin) <= 1e-3 * margin
    # and the decision follows the threshold on either side of it
    below, above = GatePolicy(0.3, threshold=margin * 1.01), GatePolicy(0.3, threshold=margin * 0.99)
    _, below_stats = tiny_engine.prefill_logits(PROMPT, policy=below)
    _, above_stats = tiny_engine.prefill_logits(PROMPT, policy=above)
    assert below_stats.policy_decisions["escalated"] and not above_stats.policy_decisions["escalated"]


def test_threshold_zero_never_escalates_and_is_reuse_plus_the_probe(tiny_engine):
    _warm(tiny_engine)
    reuse, reuse_stats = tiny_engine.prefill_logits(PROMPT, policy="reuse")
    logits, stats = tiny_engine.prefill_logits(PROMPT, policy=GatePolicy(0.3, threshold=0.0))
    assert not stats.policy_decisions["escalated"] and stats.policy_decisions["margin"] >= 0.0
    assert torch.equal(logits, reuse)
    fused, fresh = _spans(stats)
    layers = tiny_engine.runner.num_layers
    assert fused and stats.tokens_recomputed == 0
    # the main pass as reuse's, and the probe once more over the uncached tokens on every layer
    assert reuse_stats.token_layers_computed == fresh * layers
    assert stats.token_layers_computed == 2 * fresh * layers
    assert any(n.startswith("gate: first-token margin") and "reused as is" in n for n in stats.notes)


def test_threshold_above_one_always_escalates_to_prophets_selection(tiny_engine):
    _warm(tiny_engine)
    runner = tiny_engine.runner
    plan = _plan(tiny_engine, "reuse")
    gate = GatePolicy(0.3, threshold=1.01).select(PrefillView(runner, plan))
    prophet = ProphetPolicy(0.3).select(PrefillView(runner, plan))
    assert gate.token_layers == prophet.token_layers > 0
    assert gate.decided["escalated"] and 0.0 <= gate.decided["margin"] <= 1.0
    assert torch.equal(gate.initial, prophet.initial)
    fused = span_masks(plan)[0]
    assert gate.decided["selected"] == math.ceil(0.3 * int(fused.sum()) - 1e-9)

    # through the engine: the same cost and the same logits as prophet:0.3
    escalated = GatePolicy(0.3, threshold=1.01)
    logits, stats = tiny_engine.prefill_logits(PROMPT, policy=escalated)
    reference, prophet_stats = tiny_engine.prefill_logits(PROMPT, policy="prophet:0.3")
    assert torch.equal(logits, reference)
    assert stats.token_layers_computed == prophet_stats.token_layers_computed
    assert stats.tokens_recomputed == prophet_stats.tokens_recomputed > 0
    assert any("< 1.01: top 0.3 of the fused tokens recomputed" in n for n in stats.notes)


def test_the_probe_is_invisible_to_the_benchs_per_layer_capture(tiny_engine):
    from engine_sidecar.calibrate.reference import capture_last_hidden
    from engine_sidecar.execution.fused_prefill import fused_prefill

    tiny_engine.warm(PASSAGES)
    plan = _plan(tiny_engine, "reuse")
    with capture_last_hidden(tiny_engine.runner) as rows:
        fused_prefill(tiny_engine.runner, plan, GatePolicy(0.3))
    assert len(rows) == tiny_engine.runner.num_layers


def test_grammar_parses_and_rejects():
    policy = parse_policy("gate:0.2")
    assert isinstance(policy, GatePolicy) and policy.ratio == 0.2 and policy.radius == 1
    default = parse_policy("gate")
    assert isinstance(default, GatePolicy) and default.ratio == 0.3 and default.threshold == GatePolicy.threshold
    for bad in ("gate:auto", "gate:1.5", "gate:-0.1", "gate:0.2:x", "gate:0.2:nowindow"):
        with pytest.raises(PolicySpecError, match=r"gate\[:ratio\]"):
            parse_policy_spec(bad)
        with pytest.raises(InvalidPromptError):
            parse_policy(bad)
    with pytest.raises(InvalidPromptError):
        GatePolicy(0.3, threshold=math.nan)


@pytest.mark.parametrize("policy", ["gate", "gate:0.2"])
def test_api_accepts_the_grammar(tiny_engine, policy):
    from fastapi.testclient import TestClient

    from engine_sidecar.server import ServerSettings, create_app

    body = {"prompt": {"chunks": PASSAGES[:2], "question": QUESTION}, "sampling": {"max_tokens": 1}}
    with TestClient(create_app(tiny_engine, ServerSettings(max_tokens=4))) as client:
        ok = client.post("/v1/generate", json={**body, "policy": policy})
        assert ok.status_code == 200
        for bad in ("gate:auto", "gate:1.5", "gate:0.2:x"):
            error = client.post("/v1/generate", json={**body, "policy": bad})
            assert error.status_code == 422 and error.json()["error"]["param"] == "policy"
            assert "gate[:ratio]" in error.json()["error"]["message"]


def test_fidelity_bench_reports_each_questions_decision_and_cost(tiny_llama_dir, tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "fidelity.json"
    proc = subprocess.run(
        [sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", "--data", "fanoutqa", "--n", "2", "--k", "3",
         "--policies", "full,reuse,gate:0.3", "--model", str(tiny_llama_dir), "--no-transformers", "--no-disk",
         "--no-generate", "--max-tokens", "3", "--chunk-kv", "precomputed", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    rows = [r["policies"]["gate:0.3"] for r in result["rows"]]
    # the tiny random model is never sure of anything: every question escalates
    assert all(r["escalated"] and 0.0 <= r["margin"] < 0.5 and r["computed_fraction"] > 0 for r in rows)
    gate = result["policies"]["gate:0.3"]["gate"]
    assert gate["escalated_share"] == 1.0 and gate["questions"] == 2 and gate["computed_confident"] is None
    assert gate["computed_escalated"] == pytest.approx(result["policies"]["gate:0.3"]["computed_fraction"])
    assert "| gate:0.3 | 1.00 of 2 |" in out.with_suffix(".md").read_text()


def test_gate_summary_splits_the_cost_by_decision():
    from ragcache_lab.fidelity import gate_summary

    entries = [{"escalated": True, "margin": 0.1, "computed_fraction": 0.3},
               {"escalated": False, "margin": 0.9, "computed_fraction": 0.02},
               {"escalated": False, "margin": 0.7, "computed_fraction": 0.04}]
    summary = gate_summary(entries)
    assert summary["escalated_share"] == pytest.approx(1 / 3) and summary["margin_median"] == 0.7
    assert summary["computed_escalated"] == 0.3 and summary["computed_confident"] == pytest.approx(0.03)
