"""`bench fidelity` without --policies: full, reuse, cacheblend:0.15 without a temperature, the
engine's default policy (which takes the model's calibrated temperature) and the strongest new
selectors, each once, all valid for the bench."""

from __future__ import annotations

from engine_sidecar.cli.main import build_parser
from ragcache_integrations.policy_registry import DEFAULT_POLICY, parse_policy_spec
from ragcache_lab.policy_specs import (
    STRONGEST_NEW,
    default_fidelity_policies,
    fidelity_policy_list_arg,
)


def test_the_default_list_holds_baseline_default_and_new_selectors_once():
    specs = default_fidelity_policies().split(",")
    assert specs[:3] == ["full", "reuse", "cacheblend:0.15:temp1"]
    parsed = [parse_policy_spec(s) for s in specs]
    assert parse_policy_spec(DEFAULT_POLICY) in parsed
    assert all(parse_policy_spec(s) in parsed for s in STRONGEST_NEW)
    assert len(set(parsed)) == len(parsed)
    assert parse_policy_spec(DEFAULT_POLICY).temperature is None  # the engine's calibrated T applies
    assert fidelity_policy_list_arg(default_fidelity_policies()) == default_fidelity_policies()


def test_another_default_policy_is_added_after_the_baseline():
    assert default_fidelity_policies("epic:8").split(",")[3] == "epic:8"
    assert default_fidelity_policies("epic:16").count("epic") == 1 == default_fidelity_policies("epic").count("epic")


def test_the_cli_uses_it():
    args = build_parser().parse_args(["bench", "fidelity", "--data", "x.json"])
    assert args.policies == default_fidelity_policies()
    # KV computed alone and warmed after neighbours, paired: the default on neighbour KV beside the baseline
    assert args.chunk_kv == ["precomputed", "neighbours"]
    assert build_parser().parse_args(["bench", "fidelity", "--data", "x.json", "--chunk-kv", "in-context"]).chunk_kv == [
        "in-context"]
