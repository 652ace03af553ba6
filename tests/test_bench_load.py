"""`ragcache bench load` end to end on a tiny model: real sidecars (batched and --max-batch 1),
closed-loop clients at two concurrency levels, every request answered, JSON and table written."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_load_runs_both_engine_systems(tiny_llama_dir, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    records = [{"question": f"What does passage {i} say?",
                "ctxs": [{"title": f"T{i}", "text": f"Passage {i} is about rivers number {i}."},
                         {"title": f"U{i}", "text": f"Passage {i} also mentions mountains {i * 7}."}]}
               for i in range(5)]
    corpus.write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "bench", "load", "--corpus", str(corpus),
                          "--clients", "1,3", "--requests-per-client", "2", "--max-tokens", "4",
                          "--systems", "ragcache,ragcache-1seq", "--model", str(tiny_llama_dir),
                          "--dtype", "float32", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["clients"]) for r in rows] == [
        ("ragcache", 1), ("ragcache-1seq", 1), ("ragcache", 3), ("ragcache-1seq", 3)]
    for row in rows:
        assert row["errors"] == 0 and row["requests"] == 2 * row["clients"]
        assert row["output_tokens"] > 0 and row["ttft_p50_s"] is not None
    assert "| 3 | ragcache |" in out.with_suffix(".md").read_text()
