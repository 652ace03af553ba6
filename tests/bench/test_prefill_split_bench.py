"""`python -m ragcache_lab.prefill_split` end to end on a tiny model: a budget that never splits
and one that does, side by side, the stream's gaps and the pauses counted, the table and JSON
written."""

from __future__ import annotations

import json


def test_prefill_split_bench_compares_budgets(tiny_llama_dir, tmp_path, capsys):
    from ragcache_lab.prefill_split import main

    out = tmp_path / "prefill-split.json"
    assert main(["--model", str(tiny_llama_dir), "--budgets", "8192,16", "--arrivals", "2", "--k", "2",
                 "--stream-tokens", "600", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    whole, split = report["rows"]
    assert (whole["budget"], split["budget"]) == (8192, 16)
    assert whole["prefill_pauses"] == 0 and split["prefill_pauses"] > 0
    for row in report["rows"]:
        assert row["tokens"] > 0 and row["gap_max_ms"] >= row["gap_p99_ms"] >= row["gap_p50_ms"] > 0
        assert row["ttft_mean_s"] > 0
    assert "| 16 |" in out.with_suffix(".md").read_text() and "prefill pauses" in capsys.readouterr().out
