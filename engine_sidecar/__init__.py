"""ragcache engine sidecar: chunk-level KV-cache reuse for RAG."""

from engine_sidecar.engine import Engine, EngineConfig, GenerationStream
from engine_sidecar.errors import RagCacheError

__all__ = ["Engine", "EngineConfig", "GenerationStream", "RagCacheError"]
