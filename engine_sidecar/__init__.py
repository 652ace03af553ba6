"""ragcache engine sidecar: chunk-level KV-cache reuse for RAG."""

import os

# Before torch loads its OpenMP runtime: libgomp's default spin-waiting makes every parallel op
# wait a scheduler tick (~8 ms) whenever the cores are shared (other processes, a vLLM peer, a
# server thread). Sleeping threads made full prefill 3-4x faster on these shared 2-core machines
# (docs/benchmarks.md, "Prefill speed"). Set OMP_WAIT_POLICY yourself to override; it has no
# effect when torch was imported before this package.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import torch  # noqa: E402, F401
except ImportError as exc:  # the adapters install without it; the engine does not run without it
    raise ImportError("the ragcache engine needs its `engine` extra: install torch==2.13.0 first (a CPU "
                      "build, or the CUDA build you want), then `pip install 'ragcache[engine]'`") from exc

from engine_sidecar.engine import Engine  # noqa: E402
from engine_sidecar.engine_config import EngineConfig  # noqa: E402
from engine_sidecar.errors import RagCacheError  # noqa: E402
from engine_sidecar.sequence import GenerationStream  # noqa: E402

__all__ = ["Engine", "EngineConfig", "GenerationStream", "RagCacheError"]
