"""`--verify-fraction`: full prefill's first token computed beside a share of the requests that
reused KV, compared, and counted; and `tokens_fused`, the reused tokens placed at new positions."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_sidecar import Engine
from ragcache_integrations import ChunkedPrompt

PASSAGES = ["The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
            "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
            "The Danube river flows through ten countries into the Black Sea."]


def ask(chunks: list[str], question: str = "Which river reaches the Atlantic?") -> ChunkedPrompt:
    return ChunkedPrompt(chunks=chunks, question=question)


@pytest.fixture
def verifying(tiny_llama_dir, tmp_path):
    def make(fraction: float) -> Engine:
        return Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                      prefix_tree=False, verify_fraction=fraction)
    return make


def test_every_request_that_reused_kv_is_checked_and_ratio_one_agrees(verifying):
    with verifying(1.0) as engine:
        cold = engine.generate(ask(PASSAGES), {"max_tokens": 2}, policy="cacheblend:1.0")
        assert cold.stats.chunk_hits == 0 and cold.stats.verified_first_token is None  # nothing reused
        warm = engine.generate(ask(PASSAGES[::-1]), {"max_tokens": 2}, policy="cacheblend:1.0")
        # every reused token recomputed: the prefill is full prefill's, so the first tokens agree
        assert warm.stats.chunk_hits == 3 and warm.stats.verified_first_token is True
        assert "verify_s" in warm.stats.stage_times
        full = engine.generate(ask(PASSAGES), {"max_tokens": 2}, policy="full")
        assert full.stats.verified_first_token is None
        assert (engine.steps.verifier.checked, engine.steps.verifier.agreed) == (1, 1)


def test_the_fraction_checked_is_exact(verifying):
    with verifying(0.5) as engine:
        engine.generate(ask(PASSAGES), {"max_tokens": 1})
        checked = [engine.generate(ask(PASSAGES[i % 3:] + PASSAGES[: i % 3], f"q{i}?"), {"max_tokens": 1})
                   .stats.verified_first_token is not None for i in range(6)]
        assert checked == [False, True] * 3
        assert engine.steps.verifier.checked == 3


def test_off_by_default(tiny_engine):
    tiny_engine.generate(ask(PASSAGES), {"max_tokens": 1})
    again = tiny_engine.generate(ask(PASSAGES[::-1]), {"max_tokens": 1})
    assert again.stats.chunk_hits == 3 and again.stats.verified_first_token is None


def test_tokens_fused_counts_moved_kv_only(tiny_engine):
    tiny_engine.generate(ask(PASSAGES), {"max_tokens": 1}, policy="reuse")
    moved = tiny_engine.generate(ask(PASSAGES[::-1]), {"max_tokens": 1}, policy="reuse").stats
    fused = sum(s["positions"][1] - s["positions"][0] for s in moved.plan if s["mode"] == "fuse")
    assert moved.tokens_fused == fused > 0 and moved.tokens_reused > moved.tokens_fused  # the prefix is exact
    blended = tiny_engine.generate(ask(PASSAGES[1:] + PASSAGES[:1]), {"max_tokens": 1}, policy="cacheblend:0.5").stats
    assert blended.tokens_fused + blended.tokens_recomputed == sum(
        s["positions"][1] - s["positions"][0] for s in blended.plan if s["mode"] == "fuse")


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "nan"])
def test_a_bad_fraction_is_one_line(bad, tiny_llama_dir):
    proc = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "serve", "--model", str(tiny_llama_dir),
                           "--verify-fraction", bad], capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "--verify-fraction" in lines[-1] and "fraction from 0 to 1" in lines[-1]


def test_the_server_counts_checks_in_metrics(tiny_llama_dir, tmp_path):
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from engine_sidecar.server import ServerSettings, create_app

    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                prefix_tree=False, verify_fraction=1.0) as engine, \
            TestClient(create_app(engine, ServerSettings())) as client:
        body = {"prompt": {"chunks": PASSAGES, "question": "Why?"}, "sampling": {"max_tokens": 1},
                "policy": "cacheblend:1.0"}
        client.post("/v1/generate", json=body).raise_for_status()
        again = client.post("/v1/generate", json={**body, "prompt": {**body["prompt"], "chunks": PASSAGES[::-1]}})
        assert again.json()["stats"]["verified_first_token"] is True
        samples = {(s.name, s.labels.get("result")): s.value
                   for family in text_string_to_metric_families(client.get("/metrics").text) for s in family.samples}
        assert samples[("ragcache_verify_total", "agree")] == 1 and samples[("ragcache_verify_total", "differ")] == 0
