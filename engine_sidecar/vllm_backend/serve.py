"""`ragcache serve --engine vllm`: from the serve flags to a running vLLM child with ragcache's KV
connector, and the VllmBackend in front of it. Every failure before serving is one line."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from engine_sidecar.engine_args import add_engine_arguments
from engine_sidecar.server.settings import ServerSettings
from engine_sidecar.vllm_backend.launch import VLLM_ENV_HELP, VllmExited, VllmProcess, find_vllm_python
from engine_sidecar.vllm_backend.layout import VllmLayout
from engine_sidecar.vllm_backend.params import connector_config
from engine_sidecar.vllm_backend.serving import SERVED_NAME, VllmBackend
from engine_sidecar.vllm_backend.stats import ConnectorStats

# engine flags that mean something to vLLM + the connector; the others configure ragcache's own
# engine (its tiers, batching, precompute) and are reported as ignored when set
_USED = {"model", "device", "dtype", "ram_cache_gb", "conversations"}


def start_vllm_backend(args: argparse.Namespace, settings: ServerSettings) -> VllmBackend:
    from engine_sidecar.model.families import load_config
    from engine_sidecar.model.prepare import resolve_model_dir
    from engine_sidecar.request.prompt import PromptBuilder

    python = find_vllm_python(args.vllm_python)
    if python is None:
        where = args.vllm_python or "$RAGCACHE_VLLM_PYTHON or .venv-vllm/bin/python"
        raise SystemExit(f"ragcache: error: --engine vllm needs vLLM's virtualenv ({where} not found); {VLLM_ENV_HELP}")
    if args.device not in ("auto", "cpu"):
        raise SystemExit("ragcache: error: --engine vllm runs vLLM's CPU backend only so far (--device cpu)")
    for flag in ignored_flags(args):
        print(f"note: {flag} has no effect with --engine vllm", file=sys.stderr)
    model_dir = resolve_model_dir(args.model)
    max_len = args.max_model_len or load_config(model_dir).max_position_embeddings
    dtype = "float32" if args.dtype == "auto" else args.dtype  # as the engine's auto on CPU
    work = Path(tempfile.mkdtemp(prefix="ragcache-vllm-"))
    log_path = args.vllm_log or work / "vllm.log"
    stats_path = work / "connector-stats.jsonl"
    process = VllmProcess(python, model_dir, dtype, max_len, log_path, served_name=SERVED_NAME,
                          kv_transfer_config=connector_config(args.ram_cache_gb, str(stats_path),
                                                              getattr(args, "fused_temperature", "auto")))
    print(f"starting vLLM from {python} (model {model_dir.name}, {dtype}, context {max_len}; log {log_path})",
          flush=True)
    try:
        process.start(progress=lambda s: print(f"waiting for vLLM to load the model and start ({s:.0f} s; "
                                               f"log {log_path})", flush=True))
    except (VllmExited, TimeoutError) as exc:
        process.stop()
        raise SystemExit(f"ragcache: error: {exc}") from None
    except BaseException:  # Ctrl-C while waiting: no vLLM left behind
        process.stop()
        raise
    layout = VllmLayout(PromptBuilder.load(model_dir), max_conversations=max(1, args.conversations))
    return VllmBackend(process, layout, ConnectorStats(stats_path), dtype, args.ram_cache_gb,
                       settings.request_timeout_s, settings.max_queue)


def ignored_flags(args: argparse.Namespace) -> list[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    return [action.option_strings[0] for action in parser._actions
            if action.dest not in _USED and getattr(args, action.dest, action.default) != action.default]


def vllm_banner(backend: VllmBackend, settings: ServerSettings, address: str) -> str:
    process = backend.process
    return (f"ragcache serving on {address} | engine vllm ({process.url}, pid {process.proc.pid if process.proc else '-'}, "
            f"log {process.log_path}) | model {process.model_dir} | device cpu | dtype {backend.dtype} | "
            f"context {process.max_model_len} | connector RAM {backend.ram_cache_gb:g} GiB | "
            f"auth {'on' if settings.api_key else 'off'} | queue {settings.max_queue}")
