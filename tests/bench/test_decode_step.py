"""`python -m ragcache_lab.decode_step` end to end on a tiny model: both variants timed per
batch size, the table and JSON written, and the kernel's row limits restored afterwards."""

from __future__ import annotations

import json

from ragcache_kernels import cpu_native


def test_decode_step_bench_runs_both_variants(tiny_llama_dir, tmp_path, capsys):
    from ragcache_lab.decode_step import main

    before = cpu_native.LINEAR_MAX_ROWS
    out = tmp_path / "decode-step.json"
    assert main(["--model", str(tiny_llama_dir), "--batch", "1,3", "--context", "40", "--steps", "2",
                 "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["torch_step_ms"] > 0 and row["native_step_ms"] > 0 and row["speedup"] > 0
    assert report["machine"]["device"] == "cpu" and report["context"] == 40
    assert "| 3 |" in out.with_suffix(".md").read_text() and "speedup" in capsys.readouterr().out
    assert cpu_native.LINEAR_MAX_ROWS == before
