"""ragcache engine sidecar: chunk-level KV-cache reuse for RAG."""

import os

# Before torch loads its OpenMP runtime: libgomp's default spin-waiting makes every parallel op
# wait a scheduler tick whenever the cores are shared (other processes, a vLLM peer, a server
# thread); sleeping threads are much faster there (docs/benchmarks.md, "Prefill speed"). Set
# OMP_WAIT_POLICY yourself to override; it has no effect when torch was imported before this
# package.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {"Engine": "engine_sidecar.engine.engine", "EngineConfig": "engine_sidecar.engine_config",
            "RagCacheError": "engine_sidecar.errors", "GenerationStream": "engine_sidecar.engine.sequence"}


def __getattr__(name: str):
    # imported on first use, so `ragcache` can say which extra a command needs before torch loads
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(name)
    try:
        import torch  # noqa: F401
    except ImportError:  # the adapters install without it; the engine does not run without it
        # from None: the error is this message, not torch's import machinery chained above it
        raise ImportError("the ragcache engine needs its `engine` extra: install torch==2.13.0 first (a CPU "
                          "build, or the CUDA build you want), then `pip install 'ragcache[engine]'`") from None
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["Engine", "EngineConfig", "GenerationStream", "RagCacheError"]
