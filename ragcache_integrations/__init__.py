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

_CLIENT_NAMES = ("RagCacheClient", "AsyncRagCacheClient", "RagCacheAPIError", "InvalidRequestError",
                 "AuthenticationError", "RateLimitError", "ServerError", "APIConnectionError", "APITimeoutError")


def __getattr__(name: str):
    # the HTTP clients import httpx only when asked for
    if name in _CLIENT_NAMES:
        from ragcache_integrations import client

        return getattr(client, name)
    raise AttributeError(name)


__all__ = [*_CLIENT_NAMES, "Chunk", "ChunkedPrompt", "GenerationResult", "GenerationStats", "SamplingParams",
           "chunk_id_for", "normalize_text"]
