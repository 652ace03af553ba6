"""`ragcache calibrate-temperature`: the tempT spec it composes, the fit against KL
recomputed independently, the ratio-1.0 guard (nothing reused: every T is full prefill) and the
command end to end on a tiny model, with its errors."""

from __future__ import annotations

import json

import pytest

from engine_sidecar.calibrate.metrics import agreement_and_kl
from engine_sidecar.calibrate.reference import full_reference
from engine_sidecar.calibrate.temperature import (
    HoldoutCheck,
    TemperatureFit,
    check_holdout,
    fit_temperature,
    kept_temperature,
    parse_temperatures,
    with_temperature,
)
from engine_sidecar.cli.main import main
from engine_sidecar.errors import InvalidPromptError
from ragcache_integrations import ChunkedPrompt
from ragcache_integrations.policy_registry import parse_policy_spec
from tests.policy_prompt import PASSAGES, QUESTION


def test_with_temperature_composes_the_grammar():
    assert with_temperature("reuse", 1.1) == "reuse:temp1.1"
    assert with_temperature("cacheblend", 1.2) == "cacheblend:0.15:temp1.2"
    assert with_temperature("cacheblend:0.15", 0.95) == "cacheblend:0.15:temp0.95"
    assert with_temperature("prophet:0.15:nowindow", 1.0) == "prophet:0.15:nowindow:temp1"
    for spec in ("reuse", "cacheblend", "cacheblend:0.15", "epic:16", "mix:0.15:split:probe8"):
        assert parse_policy_spec(with_temperature(spec, 1.05)).temperature == 1.05
    for bad in ("full", "prefix", "cacheblend:0.15:temp1.1", "nosuch"):
        with pytest.raises(InvalidPromptError):
            with_temperature(bad, 1.1)
    assert parse_temperatures("1.1, 0.9,1.1") == [0.9, 1.1]
    for bad in ("", "0", "-1,1", "x", "inf"):
        with pytest.raises(InvalidPromptError):
            parse_temperatures(bad)


PROMPTS = [ChunkedPrompt(chunks=PASSAGES, question=QUESTION),
           ChunkedPrompt(chunks=list(reversed(PASSAGES)), question="Where is Kilimanjaro?")]


def test_fit_is_the_lowest_mean_kl_recomputed_by_hand(tiny_engine):
    fit = fit_temperature(tiny_engine, PROMPTS, "reuse", [0.8, 1.0, 1.5], max_tokens=6, progress=False)
    assert fit.questions == 2
    for t in (0.8, 1.5):
        kls = []
        for prompt in PROMPTS:
            reference = full_reference(tiny_engine, prompt, 6)
            answer = reference["row"]["token_ids"]
            logits, _ = tiny_engine.teacher_forced_logits(prompt, answer[:-1], policy=f"reuse:temp{t:g}")
            kls.append(agreement_and_kl(logits.float().log_softmax(-1), reference["logits"].log_softmax(-1))[1])
        assert fit.kl[f"{t:g}"] == pytest.approx(sum(kls) / 2, rel=1e-4, abs=1e-6)
    assert len(set(fit.kl.values())) == 3  # the temperature changes the answers' distributions
    assert fit.kl[f"{fit.best:g}"] == min(fit.kl.values())
    assert fit.best_spec == f"reuse:temp{fit.best:g}"


def test_nothing_reused_means_every_temperature_is_full_prefill(tiny_engine):
    fit = fit_temperature(tiny_engine, PROMPTS[:1], "cacheblend:1.0", [0.5, 2.0], max_tokens=6, progress=False)
    assert max(fit.kl.values()) < 1e-6 and min(fit.agreement.values()) == 1.0


def test_the_command_end_to_end(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "qa.json"
    records = [{"question": q, "answers": ["x"], "ctxs": [{"title": "", "text": c} for c in chunks]}
               for q, chunks in [(QUESTION, PASSAGES), ("Where is Kilimanjaro?", PASSAGES[::-1])] * 2]
    data.write_text(json.dumps(records))
    out = tmp_path / "fit.json"
    args = ["calibrate-temperature", "--data", str(data), "--start", "1", "--n", "2", "--k", "3",
            "--policy", "cacheblend:0.2", "--temperatures", "0.9,1.2", "--max-tokens", "5",
            "--model", str(tiny_llama_dir), "--no-disk", "--dtype", "float32", "--json", str(out)]
    assert main(args) == 0
    fit = json.loads(out.read_text())
    assert fit["questions"] == 2 and fit["start"] == 1 and fit["temperatures"] == [0.9, 1.0, 1.2]
    assert parse_policy_spec(fit["best_spec"]).temperature == fit["best"]
    # the one record after the split checks the fit (--holdout 10 asks for more than there are),
    # unless T = 1 won: then there is nothing that could fail to carry
    held = fit["holdout"]
    out_text = capsys.readouterr().out
    assert "use --policy cacheblend:0.2:temp" in out_text
    if fit["best"] == 1.0:
        assert held is None and fit["kept"] == 1.0 and "no held-out check needed" in out_text
    else:
        assert held["questions"] == 1 and held["start"] == 3 and held["temperature"] == fit["best"]
        assert fit["kept"] == (fit["best"] if held["holds"] else 1.0)
        assert "held out (1 questions from index 3)" in out_text
    # only T = 1 to try: no held-out check runs
    assert main(args + ["--temperatures", "1"]) == 0
    only_one = json.loads(out.read_text())
    assert only_one["best"] == 1.0 and only_one["holdout"] is None and only_one["kept"] == 1.0
    assert "no held-out check needed" in capsys.readouterr().out
    for bad, message in ((["--policy", "full"], "reuses no chunk KV"), (["--start", "9"], "no records"),
                         (["--temperatures", "0"], "numbers in [0.05, 20]"),
                         (["--start", "2", "--n", "2"], "no records after the calibration split"),
                         (["--holdout", "-1"], "--holdout at least 0")):
        assert main(args + bad) != 0  # argparse: the last of a repeated flag wins
        assert message in capsys.readouterr().err


def test_the_held_out_check_runs_the_fitted_t_and_t1_on_other_questions(tiny_engine):
    fit = fit_temperature(tiny_engine, PROMPTS[:1], "reuse", [0.8, 1.0, 1.5], max_tokens=6, progress=False)
    check = check_holdout(tiny_engine, PROMPTS[1:], fit, max_tokens=6, progress=False)
    by_hand = fit_temperature(tiny_engine, PROMPTS[1:], "reuse", sorted({1.0, fit.best}), max_tokens=6,
                              progress=False)
    assert check.questions == 1 and check.temperature == fit.best
    assert check.kl == pytest.approx(by_hand.kl[f"{fit.best:g}"], rel=1e-4, abs=1e-6)
    assert check.kl_untempered == pytest.approx(by_hand.kl["1"], rel=1e-4, abs=1e-6)
    assert check.wins == int(check.kl < check.kl_untempered)


def _check(t: float, kl: float, kl1: float, agreement: float, agreement1: float) -> HoldoutCheck:
    return HoldoutCheck(t, 10, kl, kl1, agreement, agreement1, wins=0)


def test_save_keeps_the_fit_only_where_it_holds_on_held_out_questions():
    fit = TemperatureFit("cacheblend:0.15", [1.0, 1.1], best=1.1)
    assert kept_temperature(fit, None) == 1.1  # no check asked for
    assert kept_temperature(fit, _check(1.1, 0.10, 0.12, 0.93, 0.92)) == 1.1
    assert kept_temperature(fit, _check(1.1, 0.13, 0.12, 0.93, 0.92)) == 1.0  # KL higher held out
    assert kept_temperature(fit, _check(1.1, 0.10, 0.12, 0.90, 0.92)) == 1.0  # agreement lower held out
    assert _check(1.0, 0.2, 0.2, 0.9, 0.9).holds  # T = 1 fitted: nothing to carry
