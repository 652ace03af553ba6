"""`python -m ragcache_lab.kv_admission` end to end on a tiny model: the same requests in the same
KV budget with buffers and with the block pool, both rows counted, the table and JSON written."""

from __future__ import annotations

import json


def test_kv_admission_bench_runs_both_variants(tiny_llama_dir, tmp_path, capsys):
    from ragcache_lab.kv_admission import main

    data = tmp_path / "qa.json"
    data.write_text(json.dumps([{"question": f"Which river is number {i}?", "answers": ["x"],
                                 "ctxs": [{"title": f"T{i}{j}", "text": f"River {i}{j} flows far to the sea."}
                                          for j in range(2)]} for i in range(3)]))
    out = tmp_path / "kv-admission.json"
    assert main(["--model", str(tiny_llama_dir), "--data", str(data), "--requests", "3", "--k", "2",
                 "--max-tokens", "24", "--kv-gib", "0.01", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    buffers, pool = report["rows"]
    assert (buffers["block_size"], pool["block_size"]) == (0, 16)
    assert buffers["answers_equal_buffers"]
    for row in report["rows"]:
        assert row["peak_batch"] >= 1 and row["output_tokens"] > 0 and row["tokens_per_s"] > 0
    assert "block pool, 16-row blocks" in out.with_suffix(".md").read_text()
    assert "most decoded at once" in capsys.readouterr().out
