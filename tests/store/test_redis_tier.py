"""The shared Redis tier against a real `redis-server` on a free port: a chunk one
store writes is a hit in another store with its own RAM; damaged and partial entries are deleted
and recomputed; another tenant's lookup misses; Redis killed, frozen or restarted empty degrades
to misses and dropped writes with the breaker open, never to an error; TTL set and refreshed; and
end to end, engine B answers from what engine A computed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

redis = pytest.importorskip("redis")
pytest.importorskip("xxhash")

from engine_sidecar.store.chunk_store import ChunkStore  # noqa: E402
from engine_sidecar.store.entry import CacheKey, ChunkKV  # noqa: E402
from engine_sidecar.store.redis_tier import CircuitBreaker, RedisTier, redacted  # noqa: E402

CPU = torch.device("cpu")


def redis_binary() -> str:
    found = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if found is None:
        if os.environ.get("RAGCACHE_REQUIRE_OPTIONAL"):
            pytest.fail("RAGCACHE_REQUIRE_OPTIONAL is set but redis-server is not installed (make redis-server)")
        pytest.skip("redis-server is not installed (make redis-server, or apt-get install redis-server)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server in a temp folder: no persistence, localhost only."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir, self.port = workdir, port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def client(self):
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = RedisServer(tmp_path_factory.mktemp("redis"))
    yield running
    running.stop()


@pytest.fixture
def prefix():
    """Each test's own key prefix on the shared server."""
    return f"test-{uuid.uuid4().hex[:8]}"


def chunk(seed: int, tokens: int = 6, layers: int = 3, dtype=torch.float32, chunk_id: str | None = "doc-1",
          tenant: str = "") -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(layers, tokens, 2, 4, generator=g).to(dtype),
                   torch.randn(layers, tokens, 2, 4, generator=g).to(dtype),
                   torch.arange(tokens) + seed, chunk_id, tenant, {"variant": "x"})


def key(name: str = "a", tenant: str = "") -> CacheKey:
    return CacheKey("model-fp", "tok-fp", name, tenant, "isolated")


def store(url: str, prefix: str, **tier) -> ChunkStore:
    return ChunkStore(1 << 20, None, CPU, redis=RedisTier(url, prefix=prefix, **tier))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_put_by_one_store_is_a_hit_in_another_with_identical_tensors(server, prefix, dtype):
    writer = store(server.url, prefix, segment_bytes=200)  # several layer-range segments
    entry = chunk(1, dtype=dtype, tenant="acme")
    writer.put(key(tenant="acme"), entry)
    writer.flush()
    fields = server.client().hkeys(f"{prefix}:{key(tenant='acme').digest}")
    assert sorted(fields) == [b"meta", b"scores", b"seg:0", b"seg:1", b"seg:2", b"tokens"]
    reader = store(server.url, prefix)  # its own, empty RAM
    assert reader.contains(key(tenant="acme"))
    got = reader.get(key(tenant="acme"))
    assert got is not None and got.keys.dtype == dtype
    assert torch.equal(got.keys, entry.keys) and torch.equal(got.values, entry.values)
    assert torch.equal(got.token_ids, entry.token_ids) and got.token_ids.dtype == torch.int64
    assert (got.chunk_id, got.tenant, got.meta) == ("doc-1", "acme", {"variant": "x"}) and got.scores is not None
    stats = reader.stats()
    assert (stats.hits_redis, stats.redis_misses, stats.redis_corrupt, stats.redis_errors) == (1, 0, 0, 0)
    assert reader.get(key(tenant="acme")) is got and reader.stats().hits_ram == 1  # promoted into RAM
    assert writer.stats().redis_writes == 1


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


@pytest.mark.parametrize("field", ["seg:1", "tokens", "scores", "meta-json", "meta-sum", "short-seg", "extra-layer"])
def test_a_damaged_entry_is_deleted_and_reported_as_a_miss(server, prefix, field):
    writer = store(server.url, prefix, segment_bytes=200)
    writer.put(key(), chunk(2))
    writer.flush()
    client, name = server.client(), f"{prefix}:{key().digest}"
    if field == "short-seg":
        client.hset(name, "seg:0", client.hget(name, "seg:0")[:-4])
    elif field == "extra-layer":  # a well-formed meta whose segments disagree with the bytes
        client.hset(name, "seg:2", client.hget(name, "seg:2") * 2)
    elif field.startswith("meta"):
        meta = client.hget(name, "meta")
        client.hset(name, "meta", flip(meta, len(meta) - 3 if field == "meta-json" else 0))
    else:
        data = client.hget(name, field)
        client.hset(name, field, flip(data, len(data) // 2))
    reader = store(server.url, prefix)
    assert reader.get(key()) is None
    stats = reader.stats()
    assert (stats.redis_corrupt, stats.hits_redis, stats.misses) == (1, 0, 1)
    assert client.exists(name) == 0  # deleted: the chunk is recomputed and written again
    writer.put(key(), chunk(2))
    writer.flush()
    assert reader.get(key()) is not None


def test_non_finite_kv_is_never_written_nor_served(server, prefix, monkeypatch):
    """Refused on put; an entry that holds NaN anyway (written by a store without the guard) is a
    damaged entry on read: deleted, counted, a miss."""
    import engine_sidecar.store.chunk_store as chunk_store
    import engine_sidecar.store.redis_tier as redis_tier
    from engine_sidecar.errors import NonFiniteKVError

    poisoned = chunk(5)
    poisoned.values[1, 2, 0, 1] = float("nan")
    writer = store(server.url, prefix)
    with pytest.raises(NonFiniteKVError):
        writer.put(key("p"), poisoned)
    writer.flush()
    client = server.client()
    assert client.exists(f"{prefix}:{key('p').digest}") == 0
    with monkeypatch.context() as m:  # an older writer: no guard
        m.setattr(chunk_store, "finite_kv_flag", lambda *_: torch.tensor(True))
        m.setattr(redis_tier, "finite_kv", lambda *_: True)
        writer.put(key("p"), poisoned)
        writer.flush()
    assert client.exists(f"{prefix}:{key('p').digest}") == 1
    reader = store(server.url, prefix)
    assert reader.get(key("p")) is None
    assert reader.stats().redis_corrupt == 1 and client.exists(f"{prefix}:{key('p').digest}") == 0


def test_an_entry_without_meta_is_a_partial_write_deleted_and_missed(server, prefix):
    writer = store(server.url, prefix)
    writer.put(key(), chunk(3))
    writer.flush()
    client, name = server.client(), f"{prefix}:{key().digest}"
    client.hdel(name, "meta")
    reader = store(server.url, prefix)
    assert reader.get(key()) is None
    assert reader.stats().redis_corrupt == 1 and client.exists(name) == 0


def test_the_write_is_one_transaction_with_meta_last(server, prefix, monkeypatch):
    tier = RedisTier(server.url, prefix=prefix, segment_bytes=200)
    calls: list[tuple[str, str]] = []
    real_pipeline = tier.client.pipeline

    def pipeline(transaction=True, **kw):
        pipe = real_pipeline(transaction=transaction, **kw)
        real_hset = pipe.hset

        def hset(name, field, value):
            calls.append(("hset", field))
            return real_hset(name, field, value)

        pipe.hset = hset
        calls.append(("multi" if transaction else "pipeline", ""))
        return pipe

    monkeypatch.setattr(tier.client, "pipeline", pipeline)
    assert tier.write(key().digest, chunk(4))
    assert calls[0] == ("multi", "") and calls[-1] == ("hset", "meta")
    assert [f for _, f in calls[1:-1]] == ["seg:0", "seg:1", "seg:2", "tokens", "scores"]


def test_another_tenants_lookup_misses_and_a_copied_entry_is_not_served(server, prefix):
    writer = store(server.url, prefix)
    writer.put(key("doc", tenant="acme"), chunk(5, tenant="acme"))
    writer.flush()
    reader = store(server.url, prefix)
    assert reader.get(key("doc", tenant="globex")) is None
    assert not reader.contains(key("doc", tenant="globex"))
    assert reader.stats().redis_misses == 1
    # the key names the tenant through the digest: even a copy under globex's key is refused
    client = server.client()
    client.copy(f"{prefix}:{key('doc', tenant='acme').digest}", f"{prefix}:{key('doc', tenant='globex').digest}")
    assert reader.get(key("doc", tenant="globex")) is None and reader.stats().redis_corrupt == 1
    assert reader.get(key("doc", tenant="acme")) is not None


def test_ttl_is_set_on_write_and_refreshed_on_hit(server, prefix):
    writer = store(server.url, prefix, ttl_s=100)
    writer.put(key(), chunk(6))
    writer.flush()
    client, name = server.client(), f"{prefix}:{key().digest}"
    assert 90_000 < client.pttl(name) <= 100_000
    client.pexpire(name, 5_000)
    assert store(server.url, prefix, ttl_s=100).get(key()) is not None
    assert client.pttl(name) > 90_000
    forever = store(server.url, prefix, ttl_s=0)  # 0: no expiry, maxmemory eviction only
    forever.put(key("b"), chunk(7))
    forever.flush()
    assert client.pttl(f"{prefix}:{key('b').digest}") == -1


def test_deletes_reach_the_redis_tier(server, prefix):
    one = store(server.url, prefix)
    one.put(key("a", "acme"), chunk(8, chunk_id="doc-1", tenant="acme"))
    one.put(key("b", "acme"), chunk(9, chunk_id="doc-2", tenant="acme"))
    one.put(key("c", "globex"), chunk(10, chunk_id="doc-1", tenant="globex"))
    one.flush()
    other = store(server.url, prefix)  # holds nothing locally: found by the walk over Redis
    assert other.delete("doc-1", tenant="acme") == 1
    assert not other.contains(key("a", "acme")) and other.contains(key("c", "globex"))
    assert other.delete(tenant="acme") == 1 and other.get(key("b", "acme")) is None
    assert other.delete() == 1 and server.client().keys(f"{prefix}:*") == []


def test_a_delete_racing_the_write_under_way_does_not_bring_the_entry_back(server, prefix):
    """remove_many while the background writer is inside that very write: once the write lands,
    the entry is deleted again (before flush returns), so Redis does not hold a deleted chunk."""
    entered, release = threading.Event(), threading.Event()

    class HeldTier(RedisTier):  # the real tier; its writes wait for the test at the start
        def write(self, digest, entry):
            entered.set()
            release.wait(10)
            return super().write(digest, entry)

    tier = HeldTier(server.url, prefix=prefix)
    digest = key("racy").digest
    tier.put(digest, chunk(11))
    assert entered.wait(10)  # the writer is inside the write now
    tier.remove_many([digest])
    release.set()
    assert tier.flush()
    assert server.client().exists(f"{prefix}:{digest}") == 0


def test_a_chunk_in_ram_on_disk_and_in_redis_is_deleted_once(server, prefix, tmp_path):
    """Regression: a full delete returned len(RAM) + len(disk) + the keys Redis removed, so one
    chunk held in all three tiers was reported as three chunks deleted."""
    tiers = ChunkStore(1 << 20, tmp_path / "kv", CPU, redis=RedisTier(server.url, prefix=prefix))
    tiers.put(key("a"), chunk(11, chunk_id="doc-1"))
    tiers.put(key("b"), chunk(12, chunk_id="doc-2"))
    tiers.flush()
    assert tiers.disk is not None and len(tiers.ram) == len(tiers.disk) == 2
    other = store(server.url, prefix)  # another sidecar's entry: Redis only, counted too
    other.put(key("c"), chunk(13, chunk_id="doc-3"))
    other.flush()
    assert tiers.delete() == 3
    assert server.client().keys(f"{prefix}:*") == [] and len(tiers.ram) == len(tiers.disk) == 0
    tiers.put(key("a"), chunk(11, chunk_id="doc-1"))
    tiers.put(key("b"), chunk(12, chunk_id="doc-2"))
    tiers.flush()
    assert tiers.delete("doc-1") == 1 and tiers.delete(tenant="") == 1  # the other paths: once too

def test_cachetune_scores_are_computed_once_for_the_disk_and_redis_tiers(server, prefix, tmp_path, monkeypatch):
    """Regression: the disk writer and the Redis writer each ran `frequency_scores` (an rFFT over
    every layer) on the same new entry. Counted on the real function, wherever the store binds it."""
    import sys

    from engine_sidecar.store.frequency import frequency_scores

    calls: list[tuple[int, ...]] = []

    def counted(keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(tuple(keys.shape))
        return frequency_scores(keys, values, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("engine_sidecar.store") and hasattr(module, "frequency_scores"):
            monkeypatch.setattr(module, "frequency_scores", counted)
    tiers = ChunkStore(1 << 20, tmp_path / "kv", CPU, redis=RedisTier(server.url, prefix=prefix))
    entry = chunk(21)
    tiers.put(key("a"), entry)
    tiers.flush()
    assert calls == [(3, 6, 2, 4)]
    from_disk = ChunkStore(1 << 20, tmp_path / "kv", CPU).get(key("a"))
    from_redis = store(server.url, prefix).get(key("a"))
    assert from_disk is not None and from_redis is not None and from_disk.scores is not None
    expected = frequency_scores(entry.keys, entry.values)
    assert torch.equal(from_disk.scores, expected) and torch.equal(from_redis.scores, expected)
    tiers.put(key("b"), from_disk)  # an entry that came with its scores: none computed
    tiers.flush()
    assert len(calls) == 1

def test_redis_killed_mid_test_degrades_to_misses_and_the_breaker_opens(tmp_path, prefix):
    own = RedisServer(tmp_path / "redis")
    try:
        tiered = store(own.url, prefix, cooldown_s=0.5)
        tiered.put(key("a"), chunk(11))
        tiered.flush()
        assert store(own.url, prefix).get(key("a")) is not None
        own.stop()
        reader = store(own.url, prefix, cooldown_s=0.5)
        started = time.monotonic()
        for name in ("a", "b", "c"):
            assert reader.get(key(name)) is None  # never an exception
        assert not reader.contains(key("a"))
        assert time.monotonic() - started < 3
        stats = reader.stats()
        assert stats.redis_errors == 3 and stats.redis_breaker_opens == 1 and stats.misses == 3
        assert reader.redis.breaker.is_open
        started = time.monotonic()
        assert reader.get(key("a")) is None and time.monotonic() - started < 0.05  # not even tried
        assert reader.stats().redis_skipped == 2  # contains() above, then this get
        tiered.put(key("d"), chunk(12))  # a write while Redis is gone: dropped, never raised
        assert tiered.redis.flush(timeout_s=5)
        assert tiered.get(key("d")) is not None  # RAM still serves it
        assert tiered.stats().redis_writes == 1 and tiered.stats().redis_errors >= 1
        # restarted empty on the same port: after the cool-down, only misses, then hits again
        own.start()
        time.sleep(0.6)
        assert reader.get(key("a")) is None and not reader.redis.breaker.is_open
        assert reader.stats().redis_misses == 1
        tiered.put(key("e"), chunk(13))
        tiered.flush()
        assert reader.get(key("e")) is not None
    finally:
        own.stop()


def test_a_closed_port_is_a_miss_and_put_never_raises(prefix):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
        tiered = store(url, prefix)
        tiered.put(key(), chunk(14))
        assert tiered.redis.flush(timeout_s=5)
        fresh = store(url, prefix)
        assert fresh.get(key()) is None and fresh.stats().redis_errors == 1
        assert tiered.get(key()) is not None  # from RAM


def test_a_frozen_redis_times_out_quickly(tmp_path, prefix):
    own = RedisServer(tmp_path / "redis")
    try:
        writer = store(own.url, prefix)
        writer.put(key(), chunk(15))
        writer.flush()
        reader = store(own.url, prefix, timeout_s=0.2)
        os.kill(own.proc.pid, signal.SIGSTOP)  # accepts nothing, answers nothing
        try:
            started = time.monotonic()
            assert reader.get(key()) is None
            assert time.monotonic() - started < 1.5
            assert reader.stats().redis_errors == 1
        finally:
            os.kill(own.proc.pid, signal.SIGCONT)
        assert reader.get(key()) is not None  # answered again once it is back
    finally:
        own.stop()


def test_a_full_redis_refusing_writes_is_counted_but_does_not_open_the_breaker(tmp_path, prefix):
    own = RedisServer(tmp_path / "redis")
    try:
        tiered = store(own.url, prefix)
        tiered.put(key("small"), chunk(16))
        tiered.flush()
        own.client().config_set("maxmemory", "1")  # 1 byte: full, and noeviction refuses writes
        own.client().config_set("maxmemory-policy", "noeviction")
        for i in range(4):
            tiered.put(key(f"big-{i}"), chunk(17 + i, tokens=2000))
        tiered.flush()
        stats = tiered.stats()
        assert stats.redis_errors == 4 and stats.redis_breaker_opens == 0 and stats.redis_writes == 1
        assert store(own.url, prefix).get(key("small")) is not None  # reads still served
    finally:
        own.stop()


def test_breaker_opens_after_failures_in_a_row_and_half_opens_after_the_cool_down():
    now = [0.0]
    breaker = CircuitBreaker(failures_to_open=3, cooldown_s=5, clock=lambda: now[0])
    assert [breaker.failure() for _ in range(2)] == [False, False] and breaker.allow()
    breaker.success()  # not in a row
    assert [breaker.failure() for _ in range(3)] == [False, False, True] and not breaker.allow()
    now[0] = 5.1
    assert breaker.allow()
    assert breaker.failure() is True and not breaker.allow() and breaker.opened == 2  # one failure reopens
    now[0] = 10.2
    breaker.success()
    assert breaker.allow() and breaker.failures == 0


def test_urls_are_shown_without_passwords():
    assert redacted("redis://user:secret@host:6380/1") == "redis://user:***@host:6380/1"
    assert redacted("redis://localhost:6379/0") == "redis://localhost:6379/0"


# --- end to end through the engine ---------------------------------------------------------------
PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]
PROMPT = {"chunks": PASSAGES, "question": "Which river reaches the Atlantic?"}


def engine(model_dir: Path, url: str):
    from engine_sidecar import Engine

    return Engine.from_pretrained(model_dir, device="cpu", dtype="float32", disk=False, prefix_tree=False,
                                  redis_url=url)


def test_engine_b_reuses_what_engine_a_computed_through_redis(tiny_llama_dir, server):
    server.client().flushdb()
    with engine(tiny_llama_dir, server.url) as first:
        assert first.warm(PASSAGES) == 3
        expected = first.generate(PROMPT, {"max_tokens": 5}).token_ids
        first.cache.store.flush()
    with engine(tiny_llama_dir, server.url) as second:
        assert len(second.cache.store.ram) == 0
        result = second.generate(PROMPT, {"max_tokens": 5})
        assert result.stats.chunk_hits == 3
        assert second.cache.store.stats().hits_redis >= 3
        assert result.token_ids == expected
        assert second.cache.costs.load.get("redis", 0) > 0  # Redis reads feed `:auto` policies' load cost
    with engine(tiny_llama_dir, server.url) as fresh:
        auto = fresh.generate(PROMPT, {"max_tokens": 1}, policy="cacheblend:auto")
        assert auto.stats.chunk_hits == 3 and any("for the redis tier" in note for note in auto.stats.notes)
    client = server.client()
    for name in client.keys("ragcache:kv:*"):  # damage every stored entry
        client.hset(name, "seg:0", flip(client.hget(name, "seg:0"), 10))
    with engine(tiny_llama_dir, server.url) as third:
        full = third.generate(PROMPT, {"max_tokens": 5}, policy="full")
        result = third.generate(PROMPT, {"max_tokens": 5})
        assert result.stats.chunk_misses == 3 and third.cache.store.stats().redis_corrupt >= 3
        assert result.token_ids == full.token_ids  # recomputed in place: full prefill's answer


def test_engine_with_redis_gone_still_answers(tiny_llama_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        with engine(tiny_llama_dir, f"redis://127.0.0.1:{s.getsockname()[1]}/0") as alone:
            alone.warm(PASSAGES)
            first = alone.generate(PROMPT, {"max_tokens": 5})
            again = alone.generate(PROMPT, {"max_tokens": 5})
            assert again.stats.chunk_hits == 3 and again.token_ids == first.token_ids  # RAM still serves
            stats = alone.cache.store.stats()
            assert stats.redis_errors >= 3 and stats.redis_breaker_opens >= 1


def test_cache_stats_and_metrics_show_the_redis_tier(tiny_llama_dir, server):
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from engine_sidecar.cli.serve import banner
    from engine_sidecar.server import ServerSettings, create_app

    server.client().flushdb()
    with engine(tiny_llama_dir, server.url) as first:
        first.warm(PASSAGES)
        first.cache.store.flush()
    with engine(tiny_llama_dir, server.url) as second:
        assert f"Redis {server.url}" in banner(second, ServerSettings(), "http://x")
        with TestClient(create_app(second, ServerSettings())) as client:
            answer = client.post("/v1/generate", json={"prompt": PROMPT, "sampling": {"max_tokens": 2}})
            assert answer.status_code == 200, answer.text
            stats = client.get("/v1/cache/stats").json()
            assert stats["hits_redis"] == 3 and stats["redis_errors"] == 0
            samples = {s.labels["event"]: s.value for family in text_string_to_metric_families(client.get("/metrics").text)
                       for s in family.samples if s.name == "ragcache_store_redis_events_total"}
            assert samples["hit"] == 3 and samples["corrupt"] == 0 and "breaker_open" in samples


def test_two_serve_processes_share_chunk_kv_through_redis(tiny_llama_dir, server, tmp_path):
    """`ragcache serve --redis-url` as real processes: what sidecar A computed is a hit in sidecar B
    (its own RAM, no disk tier), with the same answer."""
    import httpx

    from tests.server.test_server_process import ServerProcess

    server.client().flushdb()
    body = {"prompt": PROMPT, "sampling": {"max_tokens": 4}}
    answers = []
    for name in ("a", "b"):
        with ServerProcess(tiny_llama_dir, tmp_path / name, tmp_path / f"{name}.log", "--no-disk", "--no-prefix-tree",
                           "--redis-url", server.url) as sidecar:
            assert f"Redis {server.url}" in sidecar.banner
            reply = httpx.post(sidecar.base + "/v1/generate", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json())
            stats = httpx.get(sidecar.base + "/v1/cache/stats", timeout=30).json()
        # A is stopped (its writes flushed on shutdown) before B starts
    first, second = answers
    assert first["stats"]["chunk_hits"] == 0 and second["stats"]["chunk_hits"] == 3
    assert stats["hits_redis"] >= 3 and second["token_ids"] == first["token_ids"]


def test_every_store_counter_reaches_the_cache_stats_model():
    """CacheStats ignores fields it does not declare: a StoreStats counter missing there would be
    dropped from /v1/cache/stats without a word."""
    import dataclasses

    from engine_sidecar.store.chunk_store import StoreStats
    from ragcache_integrations.api_models import CacheStats

    assert {f.name for f in dataclasses.fields(StoreStats)} - set(CacheStats.model_fields) == set()
