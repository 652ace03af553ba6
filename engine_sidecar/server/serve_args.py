"""`ragcache serve`'s server flags and the ServerSettings they make: argparse only, so the
CLI, the cluster launcher and the benchmarks build the same flags without importing fastapi."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from engine_sidecar.engine_args import port_number, whole_number
from engine_sidecar.server.settings import ServerSettings

_DEFAULTS = ServerSettings()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8808, help="port (default 8808; 0 picks a free one, printed)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $RAGCACHE_API_KEY, else no auth)")
    p.add_argument("--max-queue", type=int, default=_DEFAULTS.max_queue,
                   help=f"requests queued + running before 429 (default {_DEFAULTS.max_queue})")
    p.add_argument("--max-chunks", type=int, default=_DEFAULTS.max_chunks,
                   help=f"chunks per request (default {_DEFAULTS.max_chunks})")
    p.add_argument("--max-chunk-chars", type=int, default=_DEFAULTS.max_chunk_chars,
                   help=f"characters per chunk (default {_DEFAULTS.max_chunk_chars})")
    p.add_argument("--max-tokens", type=int, default=_DEFAULTS.max_tokens,
                   help=f"largest max_tokens a request may ask for (default {_DEFAULTS.max_tokens})")
    p.add_argument("--remember-passages", type=whole_number, default=_DEFAULTS.remember_passages,
                   help="passages remembered per tenant (warmed, or sent as chunks) and found in plain chat "
                        "messages, so an OpenAI app that quotes them gets their KV reused (default "
                        f"{_DEFAULTS.remember_passages}; 0: off)")
    p.add_argument("--max-body-mb", type=float, default=_DEFAULTS.max_body_bytes / (1 << 20),
                   help=f"request body size (default {_DEFAULTS.max_body_bytes >> 20} MiB)")
    p.add_argument("--request-timeout", type=float, default=_DEFAULTS.request_timeout_s,
                   help=f"seconds per request from arrival to its last byte, queue wait included, streamed or "
                        f"not (default {_DEFAULTS.request_timeout_s:g})")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before cancelling them (default 30)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=["ragcache", "vllm"], default="ragcache",
                   help="ragcache (default): ragcache's own engine in this process; vllm: vLLM's OpenAI server as a "
                        "child process with ragcache's KV connector, behind the same API (docs/deployment.md)")
    g.add_argument("--vllm-python", type=Path, default=None,
                   help="--engine vllm: the python of vLLM's virtualenv (default $RAGCACHE_VLLM_PYTHON, else "
                        ".venv-vllm/bin/python; `make vllm-env` creates it)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="--engine vllm: vLLM's context window in tokens (default: the model's)")
    g.add_argument("--vllm-log", type=Path, default=None,
                   help="--engine vllm: vLLM's log file (default: vllm.log in a new ragcache-vllm-* temp folder)")


def settings_from_args(args: argparse.Namespace, model_name: str) -> ServerSettings:
    for name in ("max_queue", "max_chunks", "max_chunk_chars", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"ragcache: error: --{name.replace('_', '-')} must be at least 1")
    if args.request_timeout <= 0 or args.max_body_mb <= 0:
        raise SystemExit("ragcache: error: --request-timeout and --max-body-mb must be positive")
    return ServerSettings(api_key=args.api_key or os.environ.get("RAGCACHE_API_KEY") or None,
                          max_queue=args.max_queue, max_chunks=args.max_chunks, max_chunk_chars=args.max_chunk_chars,
                          max_tokens=args.max_tokens, remember_passages=args.remember_passages,
                          max_body_bytes=int(args.max_body_mb * (1 << 20)), request_timeout_s=args.request_timeout,
                          model_name=model_name)
