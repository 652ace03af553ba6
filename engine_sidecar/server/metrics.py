"""Prometheus metrics of one sidecar, in its own CollectorRegistry so several apps (tests, or
replicas in one process) never share or collide on counters."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from ragcache_integrations.types import GenerationResult

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from engine_sidecar.server.backend import ServingBackend
    from engine_sidecar.server.worker import EngineWorker

_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 600)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


def reuse_outcome(hits: int, misses: int) -> str:
    """How much of a request's chunks the cache held: hit (all), partial, miss (none), none (no chunk
    looked up: no chunks, or policy full)."""
    if not hits and not misses:
        return "none"
    return "hit" if not misses else "miss" if not hits else "partial"
# ragcache_store_redis_events' event label -> its StoreStats counter
_REDIS_EVENTS = {"hit": "hits_redis", "miss": "redis_misses", "corrupt": "redis_corrupt", "error": "redis_errors",
                 "breaker_open": "redis_breaker_opens", "skipped": "redis_skipped", "write": "redis_writes",
                 "write_dropped": "redis_writes_dropped"}


class ServerMetrics:
    def __init__(self, backend: ServingBackend | None, worker: EngineWorker):
        # no backend: only the OpenAPI schema is built; no store facts: vLLM holds the chunk KV
        self.backend, self.worker = backend, worker
        store = backend.store_facts() if backend is not None else None
        self.redis = store is not None and store.redis
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ragcache_requests", "HTTP responses by route and status", ["route", "status"],
                                registry=r)
        self.jobs = Counter("ragcache_engine_jobs", "Engine work by endpoint and outcome "
                            "(completed | disconnected | timeout | error | rejected)", ["endpoint", "outcome"],
                            registry=r)
        self.ttft = Histogram("ragcache_ttft_seconds", "Request arrival to first token, queue wait included",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_by = Histogram("ragcache_request_ttft_seconds", "Engine time to first token of completed "
                                 "generations by chunk outcome (hit | partial | miss | none) and policy name",
                                 ["outcome", "policy"], buckets=_TTFT_BUCKETS, registry=r)
        self.request_seconds = Histogram("ragcache_request_seconds", "Request arrival to its last item, completed "
                                         "engine work, by endpoint", ["endpoint"], buckets=_REQUEST_BUCKETS,
                                         registry=r)
        self.inter_token = Histogram("ragcache_inter_token_seconds", "Mean time between generated tokens of each "
                                     "completed generation (decode time / (tokens - 1))", buckets=_TOKEN_BUCKETS,
                                     registry=r)
        self.tokens = Counter("ragcache_prompt_tokens", "Prompt tokens by how they were obtained "
                              "(reused | recomputed | computed)", ["kind"], registry=r)
        self.generated = Counter("ragcache_generated_tokens", "Tokens generated", registry=r)
        self.chunks = Counter("ragcache_chunk_lookups", "Chunk lookups by outcome (hit | miss)", ["outcome"],
                              registry=r)
        self.hit_ratio = Gauge("ragcache_chunk_hit_ratio", "Chunk hits / lookups since start", registry=r)
        self.store_bytes = Gauge("ragcache_store_bytes", "Chunk store bytes per tier", ["tier"], registry=r)
        self.store_entries = Gauge("ragcache_store_entries", "Chunk store entries per tier", ["tier"], registry=r)
        self.disk_events = Counter("ragcache_store_disk_events",
                                   "Disk tier events: corrupt (file failed verification, recomputed), evicted "
                                   "(over the byte budget), write_failed (full disk, I/O error), write_dropped "
                                   "(write queue full)", ["event"], registry=r)
        self._disk_seen: dict[str, int] = {}
        for event in ("corrupt", "evicted", "write_failed", "write_dropped"):
            self.disk_events.labels(event)
        self.redis_events = Counter("ragcache_store_redis_events",
                                    "Redis tier events: hit, miss, corrupt (partial or damaged entry, deleted, "
                                    "recomputed), error (a failed call: a miss or a dropped write), breaker_open, "
                                    "skipped (not called: breaker open), write, write_dropped (write queue full)",
                                    ["event"], registry=r)
        self._redis_seen: dict[str, int] = {}
        if self.redis:
            for event in _REDIS_EVENTS:
                self.redis_events.labels(event)
        self.verify = Counter("ragcache_verify", "Requests checked against full prefill (--verify-fraction) by "
                              "whether full prefill's first token agrees with the reused prefill's "
                              "(agree | differ)", ["result"], registry=r)
        for outcome in ("agree", "differ"):
            self.verify.labels(outcome)
        self.queue_depth = Gauge("ragcache_queue_depth", "Requests queued or running on the engine", registry=r)
        self.kv_rows = Gauge("ragcache_kv_rows", "KV rows (tokens, every layer) the running requests hold: reserved "
                             "(prompt + max_tokens + 1 each, what admission counts) and used (written so far)",
                             ["kind"], registry=r)
        self.kv_blocks = Gauge("ragcache_kv_blocks", "Blocks of the KV block pool (--kv-block-size): used by the "
                               "running requests, and the pool's total (both 0 without a pool)", ["kind"], registry=r)
        self._hits = self._lookups = 0

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def job(self, endpoint: str, outcome: str, result: GenerationResult | None, seconds: float | None = None) -> None:
        self.jobs.labels(endpoint, outcome).inc()
        if outcome == "completed" and seconds is not None:
            self.request_seconds.labels(endpoint).observe(seconds)
        if result is None:
            return
        s = result.stats
        # the policy's name only (not its arguments): label values stay few
        self.ttft_by.labels(reuse_outcome(s.chunk_hits, s.chunk_misses), (s.policy or "none").split(":")[0]).observe(
            s.ttft_s)
        decode_s = s.stage_times.get("decode_s")
        if decode_s is not None and len(result.token_ids) > 1:
            self.inter_token.observe(decode_s / (len(result.token_ids) - 1))
        self.tokens.labels("reused").inc(s.tokens_reused)
        self.tokens.labels("recomputed").inc(s.tokens_recomputed)
        self.tokens.labels("computed").inc(s.tokens_computed_fresh)
        if s.verified_first_token is not None:
            self.verify.labels("agree" if s.verified_first_token else "differ").inc()
        self.generated.inc(len(result.token_ids))
        self.chunks.labels("hit").inc(s.chunk_hits)
        self.chunks.labels("miss").inc(s.chunk_misses)
        self._hits += s.chunk_hits
        self._lookups += s.chunk_hits + s.chunk_misses
        self.hit_ratio.set(self._hits / self._lookups if self._lookups else 0.0)

    def render(self) -> bytes:
        """Call it off the event loop (the store's counters are read between engine steps)."""
        store = self.backend.store_stats() if self.backend is not None else None
        if store is not None:
            self.store_bytes.labels("ram").set(store.ram_bytes)
            self.store_bytes.labels("disk").set(store.disk_bytes)
            self.store_entries.labels("ram").set(store.ram_entries)
            self.store_entries.labels("disk").set(store.disk_entries)
            if store.host_capacity_bytes:
                self.store_bytes.labels("host").set(store.host_bytes)
                self.store_entries.labels("host").set(store.host_entries)
            for event, count in (("corrupt", store.corrupt_files), ("evicted", store.disk_evictions),
                                 ("write_failed", store.disk_write_failures),
                                 ("write_dropped", store.disk_writes_dropped)):
                self.disk_events.labels(event).inc(max(0, count - self._disk_seen.get(event, 0)))
                self._disk_seen[event] = count
            if self.redis:
                for event, field in _REDIS_EVENTS.items():
                    count = getattr(store, field)
                    self.redis_events.labels(event).inc(max(0, count - self._redis_seen.get(event, 0)))
                    self._redis_seen[event] = count
        self.queue_depth.set(self.worker.depth)
        rows = self.backend.kv_rows() if self.backend is not None else None
        if rows is not None:
            self.kv_rows.labels("reserved").set(rows.reserved)
            self.kv_rows.labels("used").set(rows.used)
            self.kv_blocks.labels("used").set(rows.blocks_used)
            self.kv_blocks.labels("total").set(rows.blocks_total)
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """The registry's metrics less the `<name>_created` samples prometheus_client adds to every
    counter and histogram (their creation timestamps): a series per label set that no dashboard
    here reads. Filtered at exposition because prometheus_client's own switch,
    disable_created_metrics(), is process-wide and would change every other registry in the process."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            created = f"{family.name}_created"
            kept = copy.copy(family)  # the registry's own family objects stay as they are
            kept.samples = [s for s in family.samples if s.name != created]
            yield kept


class RequestCounter:
    """ASGI middleware counting every response by route template and status, 4xx included (a
    handler-side count would miss validation errors, which never reach the handler)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app dies before answering

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            # the router leaves the matched route in the scope: its template keeps label values
            # bounded (unmatched paths, e.g. scanners' probes, all count as "other")
            route = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.requests.labels(route, str(status)).inc()
