"""HTTP API of the sidecar: native /v1/generate, OpenAI-compatible /v1/chat/completions, cache
management, health and Prometheus metrics. Every user mistake is a 4xx JSON error naming the
field; engine work runs on one worker thread behind a bounded queue."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_sidecar.engine import Engine
from engine_sidecar.errors import PromptTooLongError, RagCacheError
from engine_sidecar.server.metrics import ServerMetrics
from engine_sidecar.server.worker import EngineWorker, QueueFull
from ragcache_integrations.api_models import (
    TENANT_PATTERN,
    CacheStats,
    ChatCompletionRequest,
    GenerateRequest,
    GenerateResponse,
    WarmRequest,
    WarmResponse,
)
from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationResult


@dataclass
class ServerSettings:
    api_key: str | None = None
    max_queue: int = 16
    max_chunks: int = 64
    max_chunk_chars: int = 32_000
    request_timeout_s: float = 600.0
    model_name: str = "ragcache"


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.field, self.kind, self.headers = status, message, field, kind, headers


def _error(status: int, message: str, kind: str, field: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "field": field}}, status_code=status,
                        headers=headers)


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    worker = EngineWorker(settings.max_queue)
    metrics = ServerMetrics(engine, worker)
    app = FastAPI(title="ragcache sidecar", version="0.1.0",
                  description="Chunk-level KV-cache reuse for RAG: native and OpenAI-compatible endpoints.")
    app.state.engine, app.state.worker, app.state.settings = engine, worker, settings

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
        return _error(422, message, "invalid_request_error", field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # e.g. a body that is not UTF-8 / cannot be parsed at all
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", None, exc.headers)

    @app.exception_handler(RagCacheError)
    async def _engine_error(_: Request, exc: RagCacheError) -> JSONResponse:
        return _error(413 if isinstance(exc, PromptTooLongError) else 400, str(exc), "invalid_request_error")

    def authorize(authorization: str | None) -> None:
        if settings.api_key and authorization != f"Bearer {settings.api_key}":
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authorization",
                           "authentication_error")

    def tenant_of(field_value: str | None, header_value: str | None) -> str:
        tenant = field_value or header_value or ""
        if tenant and not re.fullmatch(TENANT_PATTERN, tenant):
            raise ApiError(400, f"tenant must match {TENANT_PATTERN}", "tenant")
        return tenant

    def check_limits(chunks: list[Chunk]) -> None:
        if len(chunks) > settings.max_chunks:
            raise ApiError(413, f"{len(chunks)} chunks sent; the limit is {settings.max_chunks}", "chunks")
        for i, chunk in enumerate(chunks):
            if len(chunk.text) > settings.max_chunk_chars:
                raise ApiError(413, f"chunks[{i}].text has {len(chunk.text)} characters; the limit is "
                               f"{settings.max_chunk_chars}", f"chunks[{i}].text")

    async def run_stream(make, endpoint: str) -> AsyncIterator[str | GenerationResult]:
        """Start a generation on the worker; errors before the first event surface as 4xx."""
        cancelled = threading.Event()
        try:
            events = worker.stream(make, cancelled)
            first = await asyncio.wait_for(events.__anext__(), settings.request_timeout_s)
        except QueueFull:
            metrics.request(endpoint, 429)
            raise ApiError(429, f"the engine queue is full ({settings.max_queue} requests); retry shortly",
                           None, "rate_limit_error", {"Retry-After": "1"}) from None
        except TimeoutError:
            cancelled.set()
            raise ApiError(504, "request timed out", None, "timeout") from None

        async def rest() -> AsyncIterator[str | GenerationResult]:
            deadline = time.monotonic() + settings.request_timeout_s
            try:
                yield first
                async for event in events:
                    if time.monotonic() > deadline:
                        break
                    yield event
            finally:
                # runs when the client disconnects too: stop the engine at the next token now,
                # not whenever the garbage collector finalizes the generator
                cancelled.set()
                await events.aclose()

        return rest()

    def engine_events(stream) -> Iterator[str | GenerationResult]:
        yield from stream
        yield stream.result

    async def collect(events: AsyncIterator[str | GenerationResult]) -> GenerationResult:
        result = None
        async for event in events:
            if isinstance(event, GenerationResult):
                result = event
        if result is None:
            raise ApiError(504, "request timed out before it finished", None, "timeout")
        return result

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": engine.model_dir.name, "device": engine.runner.device.type,
                "dtype": str(engine.runner.dtype).removeprefix("torch."), "queue_depth": worker.depth}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(body: GenerateRequest, request: Request, authorization: str | None = Header(default=None),
                       x_ragcache_tenant: str | None = Header(default=None)):
        authorize(authorization)
        tenant = tenant_of(body.tenant, x_ragcache_tenant)
        check_limits(body.prompt.chunks)
        events = await run_stream(lambda: engine_events(engine.stream(body.prompt, body.sampling, body.policy, tenant,
                                                                      body.order)), "generate")
        if not body.stream:
            result = await collect(events)
            metrics.finished("generate", result)
            return GenerateResponse(**result.model_dump(), usage=_usage(result))

        async def sse() -> AsyncIterator[str]:
            async with aclosing(events):
                async for event in _sse_events(events):
                    yield event

        async def _sse_events(events) -> AsyncIterator[str]:
            async for event in events:
                if await request.is_disconnected():
                    break  # closing `events` stops the engine at its next token
                if isinstance(event, GenerationResult):
                    metrics.finished("generate", event)
                    payload = {"type": "done", **GenerateResponse(**event.model_dump(), usage=_usage(event)).model_dump()}
                    yield f"event: done\ndata: {json.dumps(payload)}\n\n"
                else:
                    yield f"data: {json.dumps({'type': 'delta', 'text': event})}\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, authorization: str | None = Header(default=None),
                               x_ragcache_tenant: str | None = Header(default=None)):
        authorize(authorization)
        tenant = tenant_of(body.tenant, x_ragcache_tenant)
        sampling = body.sampling()
        if body.chunks is not None:
            check_limits(body.chunks)
            users = [m for m in body.messages if m.role == "user"]
            if not users:
                raise ApiError(422, "messages: with chunks, a user message (the question) is required", "messages")
            systems = [m.content for m in body.messages if m.role == "system"]
            prompt = ChunkedPrompt(chunks=body.chunks, question=users[-1].content, conversation_id=body.conversation_id,
                                   **({"system": systems[0]} if systems else {}))

            def make():
                return engine_events(engine.stream(prompt, sampling, body.policy, tenant, body.order))
        else:
            messages = [{"role": m.role, "content": m.content} for m in body.messages]

            def make():
                return engine_events(engine.stream_chat(messages, sampling, tenant))
        events = await run_stream(make, "chat")
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        model = body.model or settings.model_name
        if not body.stream:
            result = await collect(events)
            metrics.finished("chat", result)
            return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                                 "finish_reason": result.finish_reason}],
                    "usage": _usage(result), "ragcache": result.stats.model_dump()}

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            return f"data: {json.dumps(payload)}\n\n"

        async def sse() -> AsyncIterator[str]:
            async with aclosing(events):
                async for piece in _chat_pieces():
                    yield piece

        async def _chat_pieces() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""})
            async for event in events:
                if await request.is_disconnected():
                    break
                if isinstance(event, GenerationResult):
                    metrics.finished("chat", event)
                    yield chunk({}, event.finish_reason, ragcache=event.stats.model_dump())
                    if body.stream_options and body.stream_options.get("include_usage"):
                        payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "choices": [], "usage": _usage(event)}
                        yield f"data: {json.dumps(payload)}\n\n"
                else:
                    yield chunk({"content": event})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chunks/warm", response_model=WarmResponse)
    async def warm(body: WarmRequest, authorization: str | None = Header(default=None),
                   x_ragcache_tenant: str | None = Header(default=None)) -> WarmResponse:
        authorize(authorization)
        tenant = tenant_of(body.tenant, x_ragcache_tenant)
        check_limits(body.chunks)
        try:
            computed = await worker.call(lambda: engine.warm(body.chunks, body.system, tenant))
        except QueueFull:
            raise ApiError(429, "the engine queue is full; retry shortly", None, "rate_limit_error",
                           {"Retry-After": "1"}) from None
        metrics.request("warm", 200)
        return WarmResponse(chunks=len(body.chunks), computed=computed)

    @app.get("/v1/cache/stats", response_model=CacheStats)
    async def cache_stats(authorization: str | None = Header(default=None)) -> CacheStats:
        authorize(authorization)
        s = engine.store.stats()
        return CacheStats(**s.__dict__, conversations=len(engine.conversations), cptree_nodes=engine.cptree.nodes())

    @app.delete("/v1/cache")
    async def clear_cache(chunk_id: str | None = None, authorization: str | None = Header(default=None)) -> dict:
        authorize(authorization)
        removed = await worker.call(lambda: engine.clear_cache(chunk_id))
        return {"removed": removed, "chunk_id": chunk_id}

    @app.on_event("shutdown")
    def _shutdown() -> None:
        worker.shutdown()
        engine.close()

    return app


def _usage(result: GenerationResult) -> dict[str, int]:
    prompt = result.stats.prefill_tokens_total
    return {"prompt_tokens": prompt, "completion_tokens": len(result.token_ids),
            "total_tokens": prompt + len(result.token_ids)}
