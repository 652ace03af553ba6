"""`ragcache bench prefill`, run tiny: the rows it reports and how it skips a missing vLLM."""

from __future__ import annotations

import json
import os

from engine_sidecar.cli.main import main
from ragcache_lab.prefill import Cell, build_prompts, prefill_rows


def test_prompts_have_exact_lengths_and_differ_per_repetition():
    texts = [f"passage {i}: " + " ".join(str(i * 97 + j) for j in range(40)) for i in range(20)]
    prompts = build_prompts(texts, lambda t: tuple(ord(c) for c in t), [16, 64], 3)
    assert [len(p) for p in prompts[16]] == [16, 16, 16]
    assert [len(p) for p in prompts[64]] == [64, 64, 64]
    assert len({tuple(p) for p in prompts[64]}) == 3
    # a corpus shorter than one prompt still yields full-length prompts
    short = build_prompts(["tiny"], lambda t: tuple(range(len(t))), [10], 2)
    assert [len(p) for p in short[10]] == [10, 10]


def test_ratios_compare_medians_of_the_same_dtype_and_length():
    cells = {("float32", 8, "engine"): Cell([0.8, 1.0, 1.2]), ("float32", 8, "vllm"): Cell([0.5], [0.4]),
             ("float32", 8, "transformers"): Cell([2.0])}
    rows = {r["system"]: r for r in prefill_rows(cells, ["float32"], [8], ["engine", "transformers", "vllm"])}
    assert rows["engine"]["ms_per_token"] == 1.0 * 1e3 / 8
    assert rows["engine"]["ratio_vs_vllm"] == 2.0
    assert rows["engine"]["ratio_vs_vllm_server"] == 2.5
    assert rows["engine"]["ratio_vs_transformers"] == 0.5
    assert "ratio_vs_vllm" not in rows["vllm"]


def test_bench_prefill_runs_tiny_and_skips_missing_vllm(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    monkeypatch.setenv("RAGCACHE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    out = tmp_path / "prefill.json"
    code = main(["bench", "prefill", "--model", str(tiny_llama_dir), "--data", str(tmp_path / "missing.json"),
                 "--lengths", "16,32", "--dtype", "float32,bf16", "--repeats", "2", "--warmup", "0",
                 "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["dtype"], r["tokens"], r["system"]) for r in rows} == {
        (d, n, s) for d in ("float32", "bfloat16") for n in (16, 32) for s in ("engine", "transformers")}
    for row in rows:
        assert len(row["runs_s"]) == 2 and row["ms_per_token"] > 0
        if row["system"] == "engine":
            assert row["ratio_vs_transformers"] > 0 and "ratio_vs_vllm" not in row
    assert report["config"]["source"].startswith("bundled sample")
    assert any("vLLM skipped" in note for note in report["config"]["notes"])
    printed = capsys.readouterr().out
    assert "| dtype | tokens | system |" in printed and "vLLM skipped" in printed
    assert (tmp_path / "prefill.md").read_text().startswith("| dtype |")


def test_bench_prefill_rejects_bad_flags(tiny_llama_dir, capsys):
    assert main(["bench", "prefill", "--model", str(tiny_llama_dir), "--dtype", "float16"]) != 0
    assert "float16" in capsys.readouterr().err
    assert main(["bench", "prefill", "--model", str(tiny_llama_dir), "--systems", "engine,sglang"]) != 0
    assert "sglang" in capsys.readouterr().err


def test_bench_prefill_puts_the_engine_beside_itself_with_torch_sdpa(smol_dir, tmp_path, monkeypatch):
    """engine-sdpa is the same engine with the native CPU attention turned off for its prefills
    only: both rows appear, the engine row carries the ratio, and the switch is restored."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAGCACHE_CPU_KERNELS", raising=False)
    out = tmp_path / "prefill.json"
    code = main(["bench", "prefill", "--model", str(smol_dir), "--data", str(tmp_path / "missing.json"),
                 "--lengths", "64", "--dtype", "bf16", "--repeats", "1", "--warmup", "0",
                 "--systems", "engine,engine-sdpa", "--json", str(out)])
    assert code == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"engine", "engine-sdpa"}
    assert rows["engine"]["ratio_vs_engine-sdpa"] > 0
    assert "RAGCACHE_CPU_KERNELS" not in os.environ
    assert "vs engine-sdpa" in (tmp_path / "prefill.md").read_text()
