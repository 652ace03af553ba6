"""Where framework adapters send chunk-structured prompts: an in-process Engine or a sidecar."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from ragcache_integrations.types import ChunkedPrompt, GenerationResult, SamplingParams


class Backend(Protocol):
    def stream(self, prompt: ChunkedPrompt, sampling: SamplingParams, policy: str, order: str,
               tenant: str) -> tuple[Iterator[str], Any]: ...


class EngineBackend:
    """In process (notebooks, tests): calls `engine_sidecar.Engine` directly."""

    def __init__(self, engine: Any):
        self.engine = engine

    def stream(self, prompt, sampling, policy, order, tenant):
        handle = self.engine.stream(prompt, sampling, policy=policy, tenant=tenant, order=order)
        return iter(handle), lambda: handle.result


class HttpBackend:
    """A `ragcache serve` sidecar over HTTP."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        from ragcache_integrations.client import RagCacheClient

        self.client = RagCacheClient(base_url, api_key=api_key, timeout=timeout)

    def stream(self, prompt, sampling, policy, order, tenant):
        deltas = self.client.stream(prompt, sampling, policy=policy, order=order, tenant=tenant or None)
        return deltas, lambda: self.client.last_result


def make_backend(engine: Any = None, base_url: str | None = None, api_key: str | None = None) -> Backend:
    if (engine is None) == (base_url is None):
        raise ValueError("give exactly one of engine= (an in-process Engine) or base_url= (a sidecar)")
    return EngineBackend(engine) if engine is not None else HttpBackend(base_url, api_key)


def stats_dict(result: GenerationResult | None) -> dict[str, Any]:
    return result.stats.model_dump() if result is not None else {}
