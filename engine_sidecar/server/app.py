"""The sidecar application: one engine backend (ragcache's Engine, or vLLM with ragcache's KV
connector) behind native, OpenAI-compatible and operator routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from engine_sidecar.server.auth_gate import ApiKeyGate
from engine_sidecar.server.backend import ServingBackend, as_backend
from engine_sidecar.server.body_limit import BodySizeLimit
from engine_sidecar.server.context import ServerContext
from engine_sidecar.server.errors import install_error_handlers
from engine_sidecar.server.metrics import RequestCounter, ServerMetrics
from engine_sidecar.server.openapi import install_openapi
from engine_sidecar.server.routes_admin import admin_router
from engine_sidecar.server.routes_native import native_router
from engine_sidecar.server.routes_openai import openai_router
from engine_sidecar.server.settings import ServerSettings
from engine_sidecar.server.worker import EngineWorker

if TYPE_CHECKING:
    from engine_sidecar.engine.engine import Engine

DESCRIPTION = """Chunk-level KV-cache reuse for RAG. Send retrieved chunks as structure
(`/v1/generate`, or `chunks` on `/v1/chat/completions`); cached chunk KV is reused, placed at its
new position and partly recomputed. Errors are `{"error": {message, type, field, param, code}}`."""


def create_app(engine: Engine | ServingBackend, settings: ServerSettings | None = None,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """`engine`: an Engine, or a backend (server/backend.py). `on_shutdown` runs after the worker
    stopped; `ragcache serve` passes the backend's close there (it flushes the disk tier, or stops
    vLLM). The caller owns the engine otherwise, as tests sharing one do."""
    settings = settings or ServerSettings()
    worker = EngineWorker(settings.max_queue)
    backend = as_backend(engine)
    ctx = ServerContext(backend, worker, ServerMetrics(backend, worker), settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn calls this after in-flight requests finished or were cancelled (see
        # --shutdown-grace): stop what still runs on the engine at its next token, then flush
        await asyncio.to_thread(worker.shutdown)
        if on_shutdown is not None:
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="ragcache sidecar", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    install_openapi(app)
    for router in (native_router(ctx), openai_router(ctx), admin_router(ctx)):
        app.include_router(router)
    # added last = outermost: a request without the key is refused from its headers, oversize
    # bodies before anything reads them, and every response (errors included) is counted
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ApiKeyGate, api_key=settings.api_key)
    app.add_middleware(RequestCounter, metrics=ctx.metrics)
    return app
