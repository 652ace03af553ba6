"""`ragcache serve`: the startup banner, and running uvicorn until SIGTERM/SIGINT, in front of
ragcache's engine or a vLLM child. fastapi and uvicorn are imported when the server starts."""

from __future__ import annotations

import argparse
import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_sidecar.server.serve_args import settings_from_args
from engine_sidecar.server.settings import ServerSettings

if TYPE_CHECKING:
    from engine_sidecar.engine.engine import Engine


def banner(engine: Engine, settings: ServerSettings, address: str) -> str:
    health, ram_bytes = engine.health(), engine.stats().store.ram_capacity_bytes
    disk = f"disk {health.disk_dir}" if health.disk_dir is not None else "disk off"
    if health.redis_url is not None:
        disk += f", Redis {health.redis_url}"
    return (f"ragcache serving on {address} | model {health.model_path} | device {health.device} | "
            f"dtype {health.dtype} | tiers: RAM {ram_bytes / (1 << 30):.1f} GiB, {disk} | "
            f"auth {'on' if settings.api_key else 'off'} | queue {settings.max_queue}")


def serve(args: argparse.Namespace, make_engine: Callable[[argparse.Namespace], Engine]) -> int:
    import uvicorn

    from engine_sidecar.server.app import create_app
    from engine_sidecar.server.backend import RagcacheBackend, ServingBackend

    settings = settings_from_args(args, "ragcache")  # flag errors before the model loads
    backend: ServingBackend
    if getattr(args, "engine", "ragcache") == "vllm":
        from engine_sidecar.vllm_backend.serve import start_vllm_backend, vllm_banner

        if args.max_model_len is not None and args.max_model_len < 1:
            raise SystemExit("ragcache: error: --max-model-len must be at least 1")
        vllm = start_vllm_backend(args, settings)
        backend, describe = vllm, lambda address: vllm_banner(vllm, settings, address)
    else:
        engine = make_engine(args)
        backend, describe = RagcacheBackend(engine), lambda address: banner(engine, settings, address)
    close_once = _once(backend.close)  # the disk tier flushed, or the vLLM child stopped
    try:
        settings = dataclasses.replace(settings, model_name=backend.facts().model)
    except BaseException:
        close_once()
        raise
    app = create_app(backend, settings, on_shutdown=close_once)

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # printed once the socket is bound, with the real port (--port 0)
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else args.port
                print(describe(f"http://{args.host}:{port}"), flush=True)

    # On SIGTERM/SIGINT uvicorn stops accepting, waits up to --shutdown-grace for in-flight
    # requests, cancels the rest (their engine work stops at the next token), then runs the app's
    # shutdown, which closes the engine and flushes the disk tier (or stops the vLLM child).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace, lifespan="on")
    try:
        AnnouncingServer(config).run()
    finally:
        close_once()  # also when startup failed (port taken) and the app never shut down
    return 0


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    lock, done = threading.Lock(), [False]

    def run() -> None:
        with lock:
            if not done[0]:
                done[0] = True
                fn()

    return run
