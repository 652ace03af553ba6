"""LlamaIndex integration: `ChunkCachedLLM` (drop-in LLM), and the structured path
(`ChunkCachedQueryEngine`, `ChunkCachedSynthesizer`, `FrequencyOrderPostprocessor`)."""

from ragcache_integrations.llama_index.llm import ChunkCachedLLM
from ragcache_integrations.llama_index.postprocessor import FrequencyOrderPostprocessor
from ragcache_integrations.llama_index.query_engine import ChunkCachedQueryEngine
from ragcache_integrations.llama_index.synthesizer import ChunkCachedSynthesizer

__all__ = ["ChunkCachedLLM", "ChunkCachedQueryEngine", "ChunkCachedSynthesizer", "FrequencyOrderPostprocessor"]
