"""Latency metrics an operator splits by: TTFT by chunk outcome and policy, end-to-end seconds per
endpoint, inter-token time."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine_sidecar import Engine
from engine_sidecar.server import create_app
from engine_sidecar.server.metrics import reuse_outcome

PASSAGES = ["Mount Fuji is 3,776 m high.", "The Nile flows north into the Mediterranean."]


def _samples(client) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_reuse_outcome_names():
    assert [reuse_outcome(*x) for x in ((0, 0), (2, 0), (1, 1), (0, 2))] == ["none", "hit", "partial", "miss"]


def test_ttft_by_outcome_and_policy_end_to_end_and_inter_token(tiny_llama_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv")
    try:
        with TestClient(create_app(engine)) as client:
            body = {"prompt": {"chunks": PASSAGES, "question": "How high?"}, "sampling": {"max_tokens": 5,
                                                                                          "ignore_eos": True}}
            assert client.post("/v1/generate", json=body).status_code == 200  # cold: misses
            assert client.post("/v1/generate", json={**body, "policy": "cacheblend:0.3"}).status_code == 200
            assert client.post("/v1/generate", json={**body, "policy": "full"}).status_code == 200
            m = _samples(client)
    finally:
        engine.close()
    count = "ragcache_request_ttft_seconds_count"
    assert m[(count, (("outcome", "miss"), ("policy", "cacheblend")))] == 1
    assert m[(count, (("outcome", "hit"), ("policy", "cacheblend")))] == 1  # arguments left out of the label
    assert m[(count, (("outcome", "none"), ("policy", "full")))] == 1  # full looks nothing up
    assert m[("ragcache_request_seconds_count", (("endpoint", "generate"),))] == 3
    assert m[("ragcache_inter_token_seconds_count", ())] == 3 and m[("ragcache_inter_token_seconds_sum", ())] > 0


def test_metrics_carry_no_created_series_and_leave_other_registries_alone(tiny_engine):
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    with TestClient(create_app(tiny_engine)) as client:
        body = {"prompt": {"chunks": PASSAGES, "question": "How high?"}, "sampling": {"max_tokens": 2}}
        assert client.post("/v1/generate", json=body).status_code == 200
        names = {name for name, _ in _samples(client)}
    assert {"ragcache_requests_total", "ragcache_request_ttft_seconds_count"} <= names
    assert not [n for n in names if n.endswith("_created")]
    # filtered at exposition, not switched off process-wide: another registry keeps its timestamps
    other = CollectorRegistry()
    Counter("elsewhere", "a counter of another library", registry=other).inc()
    assert b"elsewhere_created" in generate_latest(other)
