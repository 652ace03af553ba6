"""`python -m ragcache_lab.block_pool_decode` end to end on a tiny model: both variants timed per batch
size on the same KV, their logits agreeing, the table and JSON written."""

from __future__ import annotations

import json


def test_block_pool_decode_bench_times_both_variants_on_the_same_kv(tiny_llama_dir, tmp_path, capsys):
    from ragcache_lab.block_pool_decode import main

    out = tmp_path / "block-pool-decode.json"
    assert main(["--model", str(tiny_llama_dir), "--batch", "1,3", "--context", "40", "--block-size", "8",
                 "--steps", "2", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["buffers_step_ms"] > 0 and row["paged_step_ms"] > 0
        assert row["max_logit_difference"] < 1e-4  # fp32, the same KV and tokens
    assert report["machine"]["device"] == "cpu" and report["block_size"] == 8
    assert "| 3 |" in out.with_suffix(".md").read_text() and "pool / buffers" in capsys.readouterr().out
