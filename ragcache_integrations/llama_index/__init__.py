"""LlamaIndex integration: `ChunkCachedLLM` (drop-in LLM), and the structured path
(`ChunkCachedQueryEngine`, `ChunkCachedSynthesizer`, `FrequencyOrderPostprocessor`)."""

from ragcache_integrations.extras import require

require("llama_index.core", "LlamaIndex", "llama-index")

from ragcache_integrations.llama_index.llm import ChunkCachedLLM  # noqa: E402
from ragcache_integrations.llama_index.postprocessor import FrequencyOrderPostprocessor  # noqa: E402
from ragcache_integrations.llama_index.query_engine import ChunkCachedQueryEngine  # noqa: E402
from ragcache_integrations.llama_index.synthesizer import ChunkCachedSynthesizer  # noqa: E402

__all__ = ["ChunkCachedLLM", "ChunkCachedQueryEngine", "ChunkCachedSynthesizer", "FrequencyOrderPostprocessor"]
