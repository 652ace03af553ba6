"""`ragcache check` through the real command: the guards and the probe on a family's folder, the
JSON report, and a refused family in one line with exit code 2."""

from __future__ import annotations

import json

from tests.cli.test_cli_errors import assert_one_line_error, run_cli
from tests.conftest import make_family_model


def test_check_passes_a_supported_family_and_writes_its_report(tmp_path, smol_dir):
    model = make_family_model(tmp_path / "gemma", "gemma3_text", tokenizer_from=smol_dir)
    proc = run_cli("check", "--model", str(model), "--json", str(tmp_path / "check.json"), home=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["model_type"] == "gemma3_text" and report["passed"]
    results = {g["name"]: g["passed"] for g in report["guards"]}
    assert results["full prefill == transformers"] and results["cacheblend:1.0 == full"]
    assert results["Triton kernels == torch reference"] is None  # no GPU: skipped, not passed
    fidelity = report["fidelity_vs_full"]
    assert set(fidelity) == {"reuse", "cacheblend:0.15:min24"}
    assert all(0.0 <= v <= 1.0 for scores in fidelity.values() for v in scores.values())
    assert proc.stdout.strip().splitlines()[-1].startswith("verdict: PASS")


def test_check_refuses_a_hybrid_linear_attention_model_in_one_line(tmp_path):
    model = tmp_path / "next"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    proc = run_cli("check", "--model", str(model), home=tmp_path)
    assert proc.returncode == 2
    assert_one_line_error(proc, "qwen3_next", "recurrent state")
