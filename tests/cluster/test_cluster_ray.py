"""Replicas on Ray Serve sharing chunk KV through Redis, with real processes: one local
Ray per module (started once), a real `redis-server` on a free port, two tiny-model engine replicas
(1 torch thread each) behind the chunk-affinity router at /, and two more behind round robin at /rr
(round robin is how a test sends the same chunks to a replica that never computed them).

A chunk computed on replica A is a Redis hit on replica B with the same answer; a corrupted Redis
entry is recomputed; another tenant misses; the router sends chunks back to where they are; Redis
killed, then restarted empty, only turns hits into misses; a replica killed before it answered is
retried on the other one, and a stream already under way is never resent."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[cluster]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[cluster]')")
pytest.importorskip("uhashring", reason="the cluster extra is not installed (pip install -e '.[cluster]')")
pytest.importorskip("redis")

from tests.store.test_redis_tier import RedisServer, flip, free_port  # noqa: E402

REPLICA = "x-ragcache-replica"


def passages(tag: str, n: int = 3) -> list[str]:
    """Fresh chunks per test, so tests sharing the cluster never see each other's KV."""
    topics = ["river that floods its delta every spring", "mountain pass closed by snow in winter",
              "harbour town known for its lighthouse", "desert oasis on an old trade route"]
    return [f"Passage {tag}-{i}: the {topics[i % 4]} is described here in some detail. " * 4 for i in range(n)]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    running = RedisServer(tmp_path_factory.mktemp("redis-cluster"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, redis_server):
    from engine_sidecar.cli.main import build_parser
    from engine_sidecar.cluster import ray_app
    from engine_sidecar.server.settings import ServerSettings

    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--dtype", "float32", "--no-disk",
                                      "--threads", "1", "--no-prefix-tree", "--replicas", "2",
                                      "--redis-url", redis_server.url])
    port = free_port()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.monotonic()
    ray_app.run(args, ServerSettings(), 2, "127.0.0.1", port, name="affinity", replica_cpus=0.5)
    ray_app.run(args, ServerSettings(), 2, "127.0.0.1", port, router="round-robin", name="rr", replica_cpus=0.5,
                route_prefix="/rr")
    print(f"cluster up in {time.monotonic() - started:.1f} s")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    yield client
    client.close()
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def generate(client, prefix: str, chunks: list[str], question: str = "What is described?", **extra):
    body = {"prompt": {"chunks": chunks, "question": question}, "sampling": {"max_tokens": 5}, **extra}
    response = client.post(f"{prefix}/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.headers[REPLICA], response.json()


def test_router_sends_chunks_back_to_the_replica_that_holds_them(cluster):
    chunks = passages("affinity")
    home, first = generate(cluster, "", chunks)
    assert first["stats"]["chunk_misses"] == 3
    time.sleep(0.6)  # a routing-stats period or two: the replica now publishes the chunks
    for i, question in enumerate(["Where is it?", "When?", "Why is it known?"]):
        # any order of the same chunks: residency, not prefixes
        where, result = generate(cluster, "", chunks[i:] + chunks[:i], question)
        assert where == home and result["stats"]["chunk_hits"] == 3
    # streaming goes through the proxy, the ingress and the replica as a stream
    with cluster.stream("POST", "/v1/generate", json={"prompt": {"chunks": chunks, "question": "Who?"},
                                                      "sampling": {"max_tokens": 3}, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers[REPLICA] == home
        lines = [line for line in r.iter_lines() if line.startswith("event: done")]
    assert lines
    # the API is the sidecar's own: its validation errors come through unchanged
    bad = cluster.post("/v1/generate", json={"prompt": 3})
    assert bad.status_code == 422 and "error" in bad.json()


def test_a_chunk_computed_on_replica_a_is_a_redis_hit_on_b_with_the_same_answer(cluster):
    chunks = passages("shared")
    warmed = cluster.post("/rr/v1/chunks/warm", json={"chunks": chunks})
    assert warmed.status_code == 200 and warmed.json()["computed"] == 3
    a = warmed.headers[REPLICA]
    time.sleep(0.3)  # the warm-up's Redis writes are queued: let them land
    answers = {}
    # round robin mostly alternates, but Ray's router may send two in a row to one replica when
    # the machine is loaded: ask until both have answered
    for _ in range(8):
        where, result = generate(cluster, "/rr", chunks)
        assert result["stats"]["chunk_hits"] == 3
        answers[where] = result["token_ids"]
        if len(answers) == 2:
            break
    assert len(answers) == 2 and a in answers
    b = next(name for name in answers if name != a)
    assert answers[b] == answers[a]


def test_another_tenant_misses_on_every_replica(cluster):
    chunks = passages("tenant")
    warmed = cluster.post("/rr/v1/chunks/warm", json={"chunks": chunks, "tenant": "acme"})
    assert warmed.json()["computed"] == 3
    time.sleep(0.3)
    for i in range(2):
        where, result = generate(cluster, "/rr", chunks, tenant="globex")
        # globex computes its own copy on its first request, whichever replica takes it: what acme
        # stored is never its hit (the second may hit globex's own copy, locally or through Redis)
        if i == 0:
            assert result["stats"]["chunk_misses"] == 3
    where, result = generate(cluster, "/rr", chunks, tenant="acme")
    assert result["stats"]["chunk_hits"] == 3


def test_a_corrupted_redis_entry_is_recomputed(cluster, redis_server):
    chunks = passages("corrupt")
    warmed = cluster.post("/rr/v1/chunks/warm", json={"chunks": chunks})
    a = warmed.headers[REPLICA]
    time.sleep(0.3)
    client = redis_server.client()
    for name in client.keys("ragcache:kv:*"):
        client.hset(name, "seg:0", flip(client.hget(name, "seg:0"), 10))
    where, result = generate(cluster, "/rr", chunks)  # round robin: the replica without them in RAM
    assert where != a
    assert result["stats"]["chunk_misses"] == 3  # detected, deleted, computed in place
    _, full = generate(cluster, "/rr", chunks, policy="full")
    assert result["token_ids"] == full["token_ids"]


def test_redis_killed_then_restarted_empty_only_costs_misses(cluster, redis_server):
    chunks = passages("before-kill")
    cluster.post("/rr/v1/chunks/warm", json={"chunks": chunks})
    time.sleep(0.3)
    redis_server.stop()
    try:
        fresh = passages("no-redis")
        for _ in range(2):
            _, result = generate(cluster, "/rr", fresh)  # computed, kept in RAM, the Redis write dropped
        assert result["stats"]["chunk_misses"] == 3  # the other replica could not get them from Redis
        _, again = generate(cluster, "/rr", fresh)
        assert again["stats"]["chunk_hits"] == 3  # local RAM still serves
    finally:
        redis_server.start()  # empty: no persistence
    time.sleep(0.2)
    results = [generate(cluster, "/rr", chunks)[1]["stats"] for _ in range(2)]
    # one replica still has them in RAM; the other finds Redis empty: misses, never an error
    assert sorted(s["chunk_hits"] for s in results) == [0, 3]


def _replica_actor(unique_id: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(unique_id):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise LookupError(unique_id)


def test_a_replica_killed_before_answering_is_retried_and_a_started_stream_is_not(cluster):
    chunks = passages("kill")
    home, _ = generate(cluster, "", chunks)
    time.sleep(0.6)
    long = {"prompt": {"chunks": chunks, "question": "Tell me everything."},
            "sampling": {"max_tokens": 1500, "stop_token_ids": [], "temperature": 0.0}}
    outcome: dict = {}

    def call() -> None:
        r = cluster.post("/v1/generate", json=long, timeout=120)
        outcome.update(status=r.status_code, replica=r.headers.get(REPLICA), body=r.json())

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(0.5)  # routed to `home` (it holds the chunks) and generating, nothing sent yet
    ray.kill(_replica_actor(home), no_restart=True)
    worker.join(120)
    assert outcome["status"] == 200 and outcome["replica"] != home
    # a stream that already sent text ends where it is when its replica dies: never resent
    # (Serve may have started a replacement replica by now: kill whichever one answers)
    with cluster.stream("POST", "/v1/generate", json={**long, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert '"delta"' in first
        ray.kill(_replica_actor(r.headers[REPLICA]), no_restart=True)
        rest = list(lines)
    assert not any(line.startswith("event: done") for line in rest)

