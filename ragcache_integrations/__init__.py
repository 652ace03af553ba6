"""ragcache integrations: shared data types, the sidecar client and framework adapters."""

from ragcache_integrations.types import (
    Chunk,
    ChunkedPrompt,
    GenerationResult,
    GenerationStats,
    SamplingParams,
    chunk_id_for,
    normalize_text,
)


def __getattr__(name: str):
    # the HTTP clients import httpx only when asked for
    if name in ("RagCacheClient", "AsyncRagCacheClient"):
        from ragcache_integrations import client

        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["RagCacheClient", "AsyncRagCacheClient", "Chunk", "ChunkedPrompt", "GenerationResult", "GenerationStats", "SamplingParams", "chunk_id_for", "normalize_text"]
