"""`ragcache serve`'s server flags and the ServerSettings they make: argparse only, so the
CLI, the cluster launcher and the benchmarks build the same flags without importing fastapi."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from engine_sidecar.engine_args import add_flags, options_from, port_number
from engine_sidecar.engine_config import dataclass_flags
from engine_sidecar.server.settings import ServerSettings


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8808, help="port (default 8808; 0 picks a free one, printed)")
    add_flags(p, dataclass_flags(ServerSettings))
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
    """The settings from parsed flags (argparse already refused values out of range); the API key
    falls back to $RAGCACHE_API_KEY."""
    options = options_from(args, dataclass_flags(ServerSettings))
    options["api_key"] = options["api_key"] or os.environ.get("RAGCACHE_API_KEY") or None
    return ServerSettings(**options, model_name=model_name)
