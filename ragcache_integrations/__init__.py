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

__all__ = ["Chunk", "ChunkedPrompt", "GenerationResult", "GenerationStats", "SamplingParams", "chunk_id_for", "normalize_text"]
