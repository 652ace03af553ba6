"""Operator endpoints: cache statistics and deletion, health, Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine_sidecar.server.context import ServerContext
from engine_sidecar.server.engine_call import run_on_worker
from engine_sidecar.server.errors import ApiError
from engine_sidecar.server.guards import TenantHeader, auth_dependency
from engine_sidecar.server.openapi import error_responses
from engine_sidecar.server.tenancy import scope_id
from ragcache_integrations.api_models import TENANT_HEADER, CacheStats, ClearResponse, HealthResponse

T = TypeVar("T")


def admin_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    authorized = [Depends(auth_dependency(ctx.settings))]
    backend = ctx.backend

    async def off_loop(read: Callable[[], T]) -> T:
        # off the event loop (the disk tier is a folder walk) but not on the engine worker, so
        # stats stay readable while a long generation runs; --request-timeout bounds it too
        try:
            return await asyncio.wait_for(asyncio.to_thread(read), ctx.settings.request_timeout_s)
        except TimeoutError:
            raise ApiError(504, f"the request did not finish within {ctx.settings.request_timeout_s:g} s "
                                "(--request-timeout)", None, "timeout") from None

    @router.get("/v1/cache/stats", response_model=CacheStats, dependencies=authorized,
                responses=error_responses(401, 504),
                summary="Chunk store and planner counters (process-wide, all tenants)")
    async def cache_stats() -> CacheStats:
        return await off_loop(backend.cache_stats)

    @router.delete("/v1/cache", response_model=ClearResponse, dependencies=authorized,
                   responses=error_responses(400, 401, 422, 429, 501, 503, 504),
                   summary="Delete cached chunk KV of the caller's tenant (one chunk id, or all of it), or, "
                           "with all_tenants=true, of every tenant")
    async def clear_cache(request: Request, header_tenant: TenantHeader,
                          chunk_id: Annotated[str | None, Query(min_length=1, max_length=256,
                                                                description="Only this chunk's entries")] = None,
                          all_tenants: Annotated[bool, Query(description="Delete every tenant's entries (no "
                                                                         "tenant header, no chunk_id)")] = False,
                          ) -> ClearResponse:
        tenant = header_tenant or ""
        if all_tenants and (header_tenant or chunk_id is not None):
            raise ApiError(400, f"all_tenants=true deletes everything: give neither chunk_id nor {TENANT_HEADER}",
                           "all_tenants", "invalid_clear")
        target = scope_id(chunk_id, tenant) if chunk_id is not None else None
        scope = None if all_tenants else tenant
        removed = await run_on_worker(ctx, request, "clear", lambda: backend.clear_cache(target, scope))
        if target is None:  # the tenant's (or every tenant's) whole cache: its passage memory with it
            ctx.passages.forget(scope)
        return ClearResponse(removed=removed, chunk_id=chunk_id)

    @router.get("/health", response_model=HealthResponse, summary="Liveness, model and queue depth (no auth)")
    async def health() -> HealthResponse:
        facts = backend.facts()  # --engine vllm: a 503 once vLLM has exited
        return HealthResponse(status="ok", model=facts.model, model_path=facts.model_path,
                              context_window=facts.context_window, device=facts.device, dtype=facts.dtype,
                              queue_depth=ctx.worker.depth, max_queue=ctx.worker.max_queue)

    @router.head("/health", response_class=Response, summary="Liveness without a body, as load balancers probe "
                 "(no auth)")
    async def health_probe() -> Response:
        backend.facts()  # --engine vllm: a 503 once vLLM has exited
        return Response(status_code=200)

    @router.get("/metrics", response_class=Response, summary="Prometheus metrics (no auth)",
                responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                           **error_responses(504)})
    async def metrics() -> Response:
        return Response(await off_loop(ctx.metrics.render), media_type=CONTENT_TYPE_LATEST)

    return router
