"""ragcache engine sidecar: chunk-level KV-cache reuse for RAG."""

import os

# Before torch loads its OpenMP runtime: libgomp's default spin-waiting makes every parallel op
# wait a scheduler tick (~8 ms) whenever the cores are shared (other processes, a vLLM peer, a
# server thread). Sleeping threads made full prefill 3-4x faster on these shared 2-core machines
# (docs/benchmarks.md, "Prefill speed"). Set OMP_WAIT_POLICY yourself to override; it has no
# effect when torch was imported before this package.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine_sidecar.engine import Engine  # noqa: E402, EngineConfig, GenerationStream
from engine_sidecar.errors import RagCacheError  # noqa: E402

__all__ = ["Engine", "EngineConfig", "GenerationStream", "RagCacheError"]
