"""Prometheus metrics of one sidecar (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ragcache_integrations.types import GenerationResult


class ServerMetrics:
    def __init__(self, engine, worker):
        self.engine, self.worker = engine, worker
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ragcache_requests", "Requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("ragcache_ttft_seconds", "Time to first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32), registry=r)
        self.tokens = Counter("ragcache_prompt_tokens", "Prompt tokens by how they were obtained", ["kind"],
                              registry=r)
        self.chunks = Counter("ragcache_chunk_lookups", "Chunk lookups by outcome", ["outcome"], registry=r)
        self.hit_ratio = Gauge("ragcache_chunk_hit_ratio", "Chunk hits / lookups since start", registry=r)
        self.store_bytes = Gauge("ragcache_store_bytes", "Chunk store bytes per tier", ["tier"], registry=r)
        self.queue_depth = Gauge("ragcache_queue_depth", "Requests queued or running", registry=r)
        self._hits = self._lookups = 0

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def finished(self, endpoint: str, result: GenerationResult) -> None:
        s = result.stats
        self.request(endpoint, 200)
        self.ttft.observe(s.ttft_s)
        self.tokens.labels("reused").inc(s.tokens_reused)
        self.tokens.labels("recomputed").inc(s.tokens_recomputed)
        self.tokens.labels("computed").inc(s.tokens_computed_fresh)
        self.chunks.labels("hit").inc(s.chunk_hits)
        self.chunks.labels("miss").inc(s.chunk_misses)
        self._hits += s.chunk_hits
        self._lookups += s.chunk_hits + s.chunk_misses
        self.hit_ratio.set(self._hits / self._lookups if self._lookups else 0.0)

    def render(self) -> bytes:
        store = self.engine.store.stats()
        self.store_bytes.labels("ram").set(store.ram_bytes)
        self.store_bytes.labels("disk").set(store.disk_bytes)
        self.queue_depth.set(self.worker.depth)
        return generate_latest(self.registry)
