"""What the routes ask of the engine behind them: the seam between the HTTP API and an engine.

`RagcacheBackend` is ragcache's own engine (`ragcache serve`, the default); `VllmBackend`
(vllm_backend/serving.py) is vLLM with ragcache's KV connector (`ragcache serve --engine vllm`). A
generation is an iterator run on the engine worker (worker.py): text deltas, then one
GenerationResult; errors raised before the first item become ordinary HTTP errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine_sidecar.engine.sequence import GenerationStream
from engine_sidecar.engine.warm import WarmReport, auto_neighbours
from engine_sidecar.server.errors import ApiError
from ragcache_integrations.api_models import CacheStats
from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationResult, SamplingParams

if TYPE_CHECKING:
    from engine_sidecar.engine.engine import Engine
    from engine_sidecar.engine.scheduler import KVRows
    from engine_sidecar.store.chunk_store import StoreStats

Event = Any  # a generation yields str deltas then a GenerationResult; warm yields counts


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What /health and the banner report."""

    model: str
    model_path: str
    context_window: int
    device: str
    dtype: str


@dataclasses.dataclass(frozen=True)
class StoreFacts:
    """The chunk store this process holds, as /metrics and the passage memory see it."""

    disk_dir: Path | None  # where `ragcache warm` records the passages it computed; None: no disk tier
    redis: bool


class ServingBackend(Protocol):
    name: str  # "ragcache" | "vllm"

    # the chunk store this process holds and its counters (/metrics); None where it holds none
    # (vLLM's is in vLLM's worker process)
    def store_facts(self) -> StoreFacts | None: ...

    def store_stats(self) -> StoreStats | None: ...

    def kv_rows(self) -> KVRows | None: ...  # None where another process holds the request KV

    def facts(self) -> EngineFacts: ...

    def check_policy(self, policy: str) -> None: ...  # raises ApiError for a policy it cannot run

    def generate(self, prompt: ChunkedPrompt, sampling: SamplingParams, policy: str, tenant: str,
                 order: str) -> Iterator[Event]: ...

    def chat(self, messages: list[dict[str, str]], sampling: SamplingParams, tenant: str) -> Iterator[Event]: ...

    def warm(self, chunks: list[Chunk], system: str | None, tenant: str, neighbours: int = 0,
             pool: Any = None) -> WarmReport: ...

    # (the neighbours a warm-up of these chunks uses, None meaning the default; a factory of the
    # pool they are chosen from); ApiError where this engine cannot warm after neighbours
    def neighbour_pool(self, chunks: list[Chunk], neighbours: int | None) -> tuple[int, Callable[[], Any]]: ...

    def clear_cache(self, chunk_id: str | None, tenant: str | None) -> int: ...

    def cache_stats(self) -> CacheStats: ...

    def close(self) -> None: ...


def stream_events(stream: GenerationStream) -> Iterator[Event]:
    """A GenerationStream as one iterator: deltas, then the result (runs on the worker). Empty
    deltas come through too, one per token, so the worker can stop a cancelled job between
    any two tokens; `EngineCall.events` drops them."""
    yield from stream.ticks()
    assert stream.result is not None
    yield stream.result


class RagcacheBackend:
    """ragcache's own engine, in this process."""

    name = "ragcache"

    def __init__(self, engine: Engine):
        self.engine = engine  # None only when the app is built for its OpenAPI schema alone

    def store_facts(self) -> StoreFacts | None:
        if self.engine is None:
            return None
        health = self.engine.health()
        return StoreFacts(health.disk_dir, health.redis_url is not None)

    def store_stats(self) -> StoreStats | None:
        return self.engine.stats().store if self.engine is not None else None

    def kv_rows(self) -> KVRows | None:
        return self.engine.stats().kv_rows if self.engine is not None else None

    def facts(self) -> EngineFacts:
        health = self.engine.health()
        if health.failure is not None:  # /health must not say "ok" while every request would wait in vain
            raise ApiError(503, f"the engine's scheduler stopped on a fault ({health.failure}); restart the server",
                           None, "engine_failed")
        return EngineFacts(health.model, health.model_path, health.max_context, health.device, health.dtype)

    def check_policy(self, policy: str) -> None:
        return  # every policy of the grammar (guards.check_policy checked it first)

    def generate(self, prompt: ChunkedPrompt, sampling: SamplingParams, policy: str, tenant: str,
                 order: str) -> Iterator[Event]:
        return stream_events(self.engine.stream(prompt, sampling, policy, tenant, order))

    def chat(self, messages: list[dict[str, str]], sampling: SamplingParams, tenant: str) -> Iterator[Event]:
        return stream_events(self.engine.stream_chat(messages, sampling, tenant))

    def warm(self, chunks: list[Chunk], system: str | None, tenant: str, neighbours: int = 0,
             pool: Any = None) -> WarmReport:
        return self.engine.warm_report(list(chunks), system, tenant, neighbours, pool)

    def neighbour_pool(self, chunks: list[Chunk], neighbours: int | None) -> tuple[int, Callable[[], Any]]:
        if neighbours is None:
            neighbours = auto_neighbours(len({c.text for c in chunks}))
        return neighbours, (lambda: self.engine.neighbour_pool(chunks)) if neighbours else (lambda: None)

    def clear_cache(self, chunk_id: str | None, tenant: str | None) -> int:
        return self.engine.clear_cache(chunk_id, tenant)

    def cache_stats(self) -> CacheStats:
        stats = self.engine.stats()
        return CacheStats(**dataclasses.asdict(stats.store), conversations=stats.conversations,
                          cptree_nodes=stats.cptree_nodes)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def as_backend(target: Engine | ServingBackend | None) -> ServingBackend:
    """create_app takes an Engine (tests, replicas) or a ready backend."""
    if target is not None and hasattr(target, "facts") and hasattr(target, "check_policy"):
        return target  # type: ignore[return-value]
    return RagcacheBackend(target)  # type: ignore[arg-type]


__all__ = ["RagcacheBackend", "EngineFacts", "Event", "GenerationResult", "ServingBackend", "StoreFacts", "as_backend",
           "stream_events"]
