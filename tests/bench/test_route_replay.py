"""`ragcache bench route-replay`: the replica model's LRU by hand, round robin's hits by hand, the
affinity router (its real code) keeping each document's chunks on one replica where round robin
spreads them, and the command end to end."""

from __future__ import annotations

import json
import subprocess
import sys

from engine_sidecar.cluster.routing import RouterParams
from ragcache_lab.route_replay import ReplicaModel, replay
from ragcache_lab.stream import Request


def test_replica_model_is_an_lru_by_tokens():
    tokens = {"a": 4, "b": 4, "c": 4}
    model = ReplicaModel("r0", capacity_tokens=10)
    assert model.serve(("a", "b"), tokens) == (0, 2, 8)
    assert model.serve(("a",), tokens) == (1, 0, 0)  # a is now the newest
    assert model.serve(("c",), tokens) == (0, 1, 4)  # 12 > 10: b, the oldest, goes
    assert list(model.held) == ["a", "c"] and model.used_tokens == 8


def _stream(groups: list[tuple[str, ...]]) -> list[Request]:
    return [Request(f"question {i}?", g, None, 1) for i, g in enumerate(groups)]


def test_round_robin_hits_by_hand():
    stream = _stream([("x",), ("x",), ("x",), ("y",), ("y",), ("y",)])
    texts = {"x": "x " * 50, "y": "y " * 50}
    result = replay(stream, texts, {"x": 50, "y": 50}, replicas=2, clients=1, router="round-robin",
                    params=RouterParams())
    # r0 gets requests 0, 2, 4 (x miss, x hit, y miss); r1 gets 1, 3, 5 (x miss, y miss, y hit)
    assert (result.hits, result.misses) == (2, 4)
    assert result.requests == {"r0": 3, "r1": 3}
    assert result.computed_tokens == 4 * 50 + 6 * 40  # the misses' chunks and every question


def test_affinity_keeps_documents_together_where_round_robin_spreads_them():
    """Requests ask of 3 documents in a seeded random order; each replica has room for one
    document. Round robin sends every document everywhere; the router follows the chunks."""
    import random

    rng = random.Random(0)
    documents = [tuple(f"d{d}p{i}" for i in range(4)) for d in range(3)]
    groups = []
    for _ in range(90):
        doc = documents[rng.randrange(3)]
        groups.append(tuple(rng.sample(doc, 3)))
    stream = _stream(groups)
    texts = {c: f"passage {c} " * 40 for doc in documents for c in doc}
    tokens = {c: 100 for c in texts}
    rr = replay(stream, texts, tokens, 3, 1, "round-robin", RouterParams())
    affinity = replay(stream, texts, tokens, 3, 1, "affinity", RouterParams())
    assert affinity.hits > rr.hits and affinity.computed_tokens < rr.computed_tokens
    assert sum(affinity.requests.values()) == 90 == sum(affinity.reasons.values())
    again = replay(stream, texts, tokens, 3, 1, "affinity", RouterParams())
    assert (again.hits, again.requests) == (affinity.hits, affinity.requests)  # deterministic


def test_the_command_end_to_end(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path / "home"))
    records = [{"question": f"What does document {i} say about rivers?", "answers": ["x"],
                "ctxs": [{"title": f"D{i}", "text": f"Document {i}, part {j}: rivers and mountains number {j}."}
                         for j in range(5)]} for i in range(6)]
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(records))
    out = tmp_path / "replay.json"
    run = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "bench", "route-replay", "--corpus", str(corpus),
                          "--requests", "30", "--documents", "3", "--retrieval", "per-document", "--k", "2",
                          "--router-w", "1,4", "--router-slack", "0,4096", "--router-slack-requests", "1", "--model", str(tiny_llama_dir),
                          "--json", str(out)], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "RAGCACHE_HOME": str(tmp_path / "home")})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["settings"] for r in rows] == ["-"] + [f"w {w}, slack {s} / 1 requests" for w in (1, 4) for s in (0, 4096)]
    assert all(0.0 <= r["local_hit_ratio"] <= 1.0 and sum(r["reasons"].values()) == 30 for r in rows)
    assert "| round-robin |" in out.with_suffix(".md").read_text()
    bad = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "bench", "route-replay", "--corpus", str(corpus),
                          "--router-slack", "lots"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "--router-slack" in bad.stderr
