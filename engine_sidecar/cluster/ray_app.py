"""Ray Serve glue (thin on purpose: the decisions live in routing.py, the HTTP API in server/).

    HTTP -> Ray Serve proxy -> Ingress (1 replica, no engine) --handle--> EngineReplica x N
                                  reads the body once, sums up         runs `ragcache serve`'s FastAPI
                                  its chunks (RouteInfo)               app in-process, streams back

The ingress exists because Ray's proxy hands a FastAPI ingress an opaque ASGI request: a router
could not see the chunks. Calling the engine deployment through a handle puts the chunk summary in
`PendingRequest.args`, where `ChunkAffinityRouter` reads it.

Failure handling: a call that fails before the replica sent any body byte (the replica died or
became unreachable) is sent again and the router, which dropped the dead replica, picks another;
once bytes reached the client the stream ends there (a retry would duplicate text).
"""


import argparse
import asyncio
import fcntl
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine_sidecar.cluster.asgi_bridge import request_payload, run_asgi
from engine_sidecar.cluster.residency import QueuedTokens, request_work, routing_stats
from engine_sidecar.cluster.routing import (
    HomeRing,
    RouteInfo,
    RouterParams,
    RouterState,
    choose,
    route_info_from_body,
)
from engine_sidecar.server.settings import ServerSettings
from ragcache_integrations.api_models import TENANT_HEADER

log = logging.getLogger("ragcache.cluster")
RETRYABLE_ATTEMPTS = 3  # sends of one request before it fails (each to a live replica)
STATS_PERIOD_S = 0.25  # how often replicas publish residency: a few requests' worth at most


def _route_of(pending_request: PendingRequest | None) -> RouteInfo:
    if pending_request is None or not pending_request.args:
        return RouteInfo()
    payload = pending_request.args[0]
    return RouteInfo.from_wire(payload.get("route")) if isinstance(payload, dict) else RouteInfo()


class ChunkAffinityRouter(RequestRouter):
    """routing.choose over Ray's candidates; every replica's stats as it last published them."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.params = RouterParams(**kwargs)
        self.ring = HomeRing()
        self.state = RouterState(decay=self.params.decay)
        self.decisions: dict[str, int] = {}
        self.work: dict[str, dict[str, float]] = {}  # request id -> estimated work per replica

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self.state.view(name, r.routing_stats) for name, r in by_name.items()]
        route = _route_of(pending_request)
        decision = choose(route, views, self.ring, self.params)
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        log.debug("route %s: %s %s", decision.reason, decision.ranked, decision.scores)
        if pending_request is not None:
            if len(self.work) > 10_000:  # requests chosen for but never sent (cancelled): drop the estimates
                self.work.clear()
            request_id = pending_request.metadata.internal_request_id
            self.work[request_id] = decision.work
            if decision.ranked:
                self.state.chosen(decision.ranked[0], route, request_id, decision.work[decision.ranked[0]])
        return [[by_name[name]] for name in decision.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        work = self.work.pop(request_id, {}).get(replica_id.unique_id)
        self.state.routed(replica_id.unique_id, _route_of(pending_request), request_id, work)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.state.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.state.forget(replica_id.unique_id)


class RoundRobinRouter(RequestRouter):
    """The baseline `ragcache bench cluster` compares against: replicas in turn, whatever they hold."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        start = self.turn % len(ordered)
        self.turn += 1
        return [[r] for r in ordered[start:] + ordered[:start]]


ROUTERS: dict[str, type[RequestRouter]] = {"affinity": ChunkAffinityRouter, "round-robin": RoundRobinRouter}


def _claim_disk_slot(base: Path, slots: int) -> Path:
    """A disk-tier folder of its own for this replica (two engines must not share one), the same
    one after a restart when its slot is free again: slot-i folders held by an flock."""
    base.mkdir(parents=True, exist_ok=True)
    for i in range(max(slots, 1) * 4):
        folder = base / f"replica-{i}"
        folder.mkdir(exist_ok=True)
        handle = open(folder / ".lock", "w")  # noqa: SIM115 (held open for the process' life)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        _HELD_LOCKS.append(handle)
        return folder
    raise RuntimeError(f"no free disk-tier slot under {base}")


_HELD_LOCKS: list[Any] = []


@serve.deployment(max_ongoing_requests=16, health_check_period_s=2.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=10.0)
class EngineReplica:
    def __init__(self, engine_args: argparse.Namespace, settings: ServerSettings, replicas: int):
        import torch

        from engine_sidecar.engine_args import engine_from_args
        from engine_sidecar.server.app import create_app

        args = argparse.Namespace(**vars(engine_args))
        if args.threads:
            torch.set_num_threads(args.threads)
        if not args.no_disk:
            from engine_sidecar.paths import default_cache_dir

            args.cache_dir = _claim_disk_slot(Path(args.cache_dir or default_cache_dir()), replicas)
        self.engine = engine_from_args(args)
        self.app = create_app(self.engine, settings)
        self.queued = QueuedTokens()
        self.seq = 0
        self.name = serve.get_replica_context().replica_id.unique_id

    async def serve_http(self, payload: dict[str, Any]) -> AsyncIterator[Any]:
        tokens = request_work(self.engine, RouteInfo.from_wire(payload.get("route")))
        self.queued.add(tokens)
        try:
            first = True
            async for item in run_asgi(self.app, payload):
                if first:  # the ingress tells clients (and the bench) which replica answered
                    item = {**item, "headers": [*item["headers"], (b"x-ragcache-replica", self.name.encode())]}
                    first = False
                yield item
        finally:
            self.queued.done(tokens)

    def record_routing_stats(self) -> dict[str, Any]:
        self.seq += 1
        return routing_stats(self.engine, self.queued, self.seq)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            ctx = self.app.state.ctx
            ctx.worker.shutdown()
            engine.close()


def _is_event_stream(start: dict[str, Any]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start["headers"])


async def _next_or_none(stream: Any) -> bytes | None:
    """A non-streamed body arrives whole: wait for it before answering, so a replica that dies
    while computing it is retried elsewhere instead of cutting a response mid-way."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _rest(first: bytes | None, stream: Any) -> AsyncIterator[bytes]:
    if first:
        yield first
    try:
        async for piece in stream:
            yield piece
    except Exception as exc:  # bytes already reached the client: end the stream, never resend
        log.warning("replica failed mid-stream; the response ends here: %s", exc)


ingress_app = FastAPI(title="ragcache cluster ingress", docs_url=None, redoc_url=None, openapi_url=None)
_BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


@serve.deployment(max_ongoing_requests=1000, num_replicas=1)
@serve.ingress(ingress_app)
class Ingress:
    def __init__(self, engines: Any):
        self.engines = engines.options(stream=True)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"], include_in_schema=False)
    async def forward(self, path: str, request: Request) -> Any:
        # the path below this app's route prefix: what `ragcache serve` would have seen
        path = "/" + path
        body = await request.body() if request.method in _BODY_METHODS else b""
        route = None
        if request.method == "POST" and body:
            try:
                parsed = json.loads(body)
                if isinstance(parsed, dict):
                    route = route_info_from_body(path, parsed, request.headers.get(TENANT_HEADER)).to_wire()
            except (ValueError, AttributeError, TypeError):
                route = None  # the replica answers the malformed body with its own 4xx
        payload = request_payload(request.method, path, request.url.query.encode(),
                                  [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
                                  body, route)
        last_error: BaseException | None = None
        for attempt in range(RETRYABLE_ATTEMPTS):
            stream = self.engines.serve_http.remote(payload)
            try:
                start = await stream.__anext__()
                first_body = await _next_or_none(stream) if not _is_event_stream(start) else None
            except (RayActorError, ActorUnavailableError) as exc:  # died or unreachable before answering
                last_error = exc
                log.warning("replica failed before answering (attempt %d): %s", attempt + 1, exc)
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]
                       if k.lower() not in (b"content-length", b"transfer-encoding")}
            return StreamingResponse(_rest(first_body, stream), status_code=start["status"], headers=headers)
        return JSONResponse({"error": {"message": f"no replica could serve the request: {last_error}", "type": "unavailable",
                                       "field": None, "param": None, "code": "no_replica"}}, status_code=503)


def build_app(engine_args: argparse.Namespace, settings: ServerSettings, replicas: int, router: str = "affinity",
              replica_cpus: float = 1.0, router_kwargs: dict[str, Any] | None = None) -> Any:
    engine = EngineReplica.options(
        num_replicas=replicas, max_ongoing_requests=settings.max_queue,
        ray_actor_options={"num_cpus": replica_cpus},
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[router],
                                                  request_router_kwargs=router_kwargs or {},
                                                  request_routing_stats_period_s=STATS_PERIOD_S,
                                                  request_routing_stats_timeout_s=5.0),
    ).bind(engine_args, settings, replicas)
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(engine)


def start_ray(address: str | None, replicas: int, replica_cpus: float) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {k: v for k, v in os.environ.items()
                        if k in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "RAGCACHE_HOME", "TRANSFORMERS_VERBOSITY")}}
    if address:
        ray.init(address=address, runtime_env=env, logging_level=logging.WARNING)
    else:  # a single-machine Ray sized for the replicas (logical CPUs: Ray's own bookkeeping)
        ray.init(num_cpus=max(1, int(replicas * replica_cpus + 1)), include_dashboard=False,
                 runtime_env=env, logging_level=logging.WARNING, log_to_driver=False)


def run(engine_args: argparse.Namespace, settings: ServerSettings, replicas: int, host: str, port: int,
        router: str = "affinity", replica_cpus: float = 1.0, address: str | None = None,
        name: str = "ragcache", router_kwargs: dict[str, Any] | None = None, route_prefix: str = "/") -> Any:
    """Start (or join) Ray, start Serve's HTTP proxy on host:port and deploy; returns when every
    replica is up. The handle of the ingress is returned for callers that want one."""
    start_ray(address, replicas, replica_cpus)
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    started = time.monotonic()
    handle = serve.run(build_app(engine_args, settings, replicas, router, replica_cpus, router_kwargs), name=name,
                       route_prefix=route_prefix, logging_config={"log_level": "WARNING"})
    log.info("%d replicas up in %.1f s", replicas, time.monotonic() - started)
    return handle
