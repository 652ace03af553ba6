"""What the routes ask of the engine behind them: the seam between the HTTP API and an engine.

`EngineBackend` is ragcache's own engine (`ragcache serve`, the default); `VllmBackend`
(vllm_backend/serving.py) is vLLM with ragcache's KV connector (`ragcache serve --engine vllm`). A
generation is an iterator run on the engine worker (worker.py): text deltas, then one
GenerationResult; errors raised before the first item become ordinary HTTP errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from engine_sidecar.engine.sequence import GenerationStream
from engine_sidecar.engine.warm import WarmReport, auto_neighbours, neighbour_index
from engine_sidecar.server.errors import ApiError
from ragcache_integrations.api_models import CacheStats
from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationResult, SamplingParams

if TYPE_CHECKING:
    from engine_sidecar.engine.engine import Engine
    from engine_sidecar.store.chunk_store import ChunkStore

Event = Any  # a generation yields str deltas then a GenerationResult; warm yields counts
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What /health and the banner report."""

    model: str
    model_path: str
    context_window: int
    device: str
    dtype: str


class ServingBackend(Protocol):
    name: str  # "ragcache" | "vllm"

    @property
    def store(self) -> ChunkStore | None: ...  # the chunk store this process holds (metrics), if any

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


def _read_racing(read: Callable[[], T], fallback: T, attempts: int = 3) -> T:
    # Stats read structures the engine thread mutates (dicts, the disk folder) without a lock
    # shared with us; a read that races a write raises, and simply reading again is enough.
    for _ in range(attempts):
        try:
            return read()
        except (RuntimeError, OSError):
            continue
    return fallback


class EngineBackend:
    """ragcache's own engine, in this process."""

    name = "ragcache"

    def __init__(self, engine: Engine):
        self.engine = engine  # None only when the app is built for its OpenAPI schema alone

    @property
    def store(self) -> ChunkStore | None:
        return self.engine.store if self.engine is not None else None

    def facts(self) -> EngineFacts:
        engine = self.engine
        failure = engine.scheduler.failure
        if failure is not None:  # /health must not say "ok" while every request would wait in vain
            raise ApiError(503, f"the engine's scheduler stopped on a fault ({failure}); restart the server",
                           None, "engine_failed")
        return EngineFacts(engine.model_dir.name, str(engine.model_dir), engine.max_context,
                           engine.runner.device.type, str(engine.runner.dtype).removeprefix("torch."))

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
        return neighbours, (lambda: neighbour_index(self.engine.builder, chunks)) if neighbours else (lambda: None)

    def clear_cache(self, chunk_id: str | None, tenant: str | None) -> int:
        return self.engine.clear_cache(chunk_id, tenant)

    def cache_stats(self) -> CacheStats:
        engine = self.engine
        store = _read_racing(engine.store.stats, None)
        return CacheStats(**(dataclasses.asdict(store) if store is not None else {}),
                          conversations=_read_racing(lambda: len(engine.conversations), 0),
                          cptree_nodes=_read_racing(engine.cptree.nodes, 0))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def as_backend(engine: Engine | ServingBackend | None) -> ServingBackend:
    """create_app takes an Engine (tests, replicas) or a ready backend."""
    if engine is not None and hasattr(engine, "facts") and hasattr(engine, "check_policy"):
        return engine  # type: ignore[return-value]
    return EngineBackend(engine)  # type: ignore[arg-type]


__all__ = ["EngineBackend", "EngineFacts", "Event", "GenerationResult", "ServingBackend", "as_backend",
           "stream_events"]
