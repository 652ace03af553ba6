"""The native API: chunk-structured generation (JSON or server-sent events) and chunk warming."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request

from engine_sidecar.engine.warm import WarmReport
from engine_sidecar.errors import RagCacheError
from engine_sidecar.server.context import ServerContext
from engine_sidecar.server.engine_call import EngineCall
from engine_sidecar.server.errors import ApiError, engine_error_status, error_body
from engine_sidecar.server.guards import (
    TenantHeader,
    auth_dependency,
    cap_max_tokens,
    check_chunks,
    check_policy,
    check_stops,
    resolve_tenant,
)
from engine_sidecar.server.openapi import ENGINE_ERRORS, GENERATE_EVENT, error_responses, sse_responses
from engine_sidecar.server.sse import sse, sse_response
from engine_sidecar.server.tenancy import scope_chunks, scope_prompt
from ragcache_integrations.api_models import (
    GenerateRequest,
    GenerateResponse,
    Usage,
    WarmRequest,
    WarmResponse,
)
from ragcache_integrations.types import GenerationResult


def native_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(dependencies=[Depends(auth_dependency(ctx.settings))], responses=error_responses(*ENGINE_ERRORS))
    backend, settings = ctx.backend, ctx.settings

    @router.post("/v1/generate", response_model=GenerateResponse, responses=sse_responses(GENERATE_EVENT),
                 summary="Answer a chunk-structured prompt (JSON, or server-sent events with stream=true)")
    async def generate(body: GenerateRequest, request: Request,
                       header_tenant: TenantHeader):
        tenant = resolve_tenant(body.tenant, header_tenant)
        check_policy(body.policy, backend)
        check_chunks(body.prompt.chunks, settings, "prompt.chunks")
        check_stops(body.sampling.stop, settings, "sampling.stop")
        sampling = cap_max_tokens(body.sampling, "max_tokens" in body.sampling.model_fields_set, settings,
                                  "sampling.max_tokens")
        prompt = scope_prompt(body.prompt, tenant)

        def make() -> Iterator[str | GenerationResult]:
            events = backend.generate(prompt, sampling, body.policy, tenant, body.order)
            return ctx.passages.remembering(events, prompt.chunks, tenant)

        call = EngineCall(ctx, request, "generate", make, tenant)
        await call.start()
        if not body.stream:
            result = await call.result_of()
            return GenerateResponse(**result.model_dump(), usage=Usage.of(result))
        return sse_response(_generate_events(call, settings.request_timeout_s))

    @router.post("/v1/chunks/warm", response_model=WarmResponse,
                 summary="Precompute and store the KV of chunks not cached yet")
    async def warm(body: WarmRequest, request: Request,
                   header_tenant: TenantHeader) -> WarmResponse:
        tenant = resolve_tenant(body.tenant, header_tenant)
        check_chunks(body.chunks, settings)
        chunks = scope_chunks(body.chunks, tenant)

        neighbours, make_pool = backend.neighbour_pool(chunks, body.neighbours)  # an unsupported engine says so here

        def make() -> Iterator[WarmReport]:
            # the pool once (tokenizing every chunk, off the event loop), then one chunk at a time,
            # so a disconnect or the deadline stops between chunks
            pool = make_pool()
            for chunk in chunks:
                yield backend.warm([chunk], body.system, tenant, neighbours, pool)
                ctx.passages.remember([chunk], tenant)  # once computed (or found cached)

        if not chunks:
            return WarmResponse(chunks=0, computed=0)
        call = EngineCall(ctx, request, "warm", make, tenant, generation=False)
        await call.start()
        reports = await call.collect()
        return WarmResponse(chunks=len(chunks), computed=sum(r.computed for r in reports), neighbours=neighbours,
                            tokens_prefilled=sum(r.tokens_prefilled for r in reports),
                            seconds=round(sum(r.seconds for r in reports), 4))

    return router


async def _generate_events(call: EngineCall, timeout_s: float) -> AsyncIterator[str]:
    """`data: {"type": "delta", "text"}` per delta, then `event: done` with the full response;
    a failure after the first token ends the stream with `event: error`."""
    try:
        async with aclosing(call.events()) as events:
            async for event in events:
                if isinstance(event, GenerationResult):
                    done = GenerateResponse(**event.model_dump(), usage=Usage.of(event))
                    yield sse({"type": "done", **done.model_dump(mode="json")}, "done")
                else:
                    yield sse({"type": "delta", "text": event})
    except RagCacheError as exc:
        status = engine_error_status(exc)
        yield sse({"type": "error", "status": status, **error_body(status, str(exc))}, "error")
        return
    except ApiError as exc:  # --engine vllm: vLLM failed or exited mid-answer
        yield sse({"type": "error", "status": exc.status, **error_body(exc.status, exc.message, None, exc.code)},
                  "error")
        return
    except Exception:
        yield sse({"type": "error", "status": 500, **error_body(500, "internal error; the server log has the details")},
                  "error")
        raise
    if call.outcome == "timeout":
        yield sse({"type": "error", "status": 504, **error_body(504, f"the request did not finish within {timeout_s:g} s "
                                                      "(--request-timeout)", None, "timeout")}, "error")
