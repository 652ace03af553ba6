"""A replica's routing stats: which chunks it holds (by tier), its queued prompt tokens and its
measured load/compute ratios, as the plain dict Ray Serve hands the router (see routing.py).

No Ray import: the deployment in ray_app.py calls `routing_stats` from its `record_routing_stats`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from engine_sidecar.cluster.routing import (
    STATS_VERSION,
    ReplicaView,
    RouteInfo,
    RouterParams,
    chunk_key,
    missing_tokens,
)

if TYPE_CHECKING:
    from engine_sidecar.engine.engine import Engine

DEFAULT_DISK_RATIO = 0.1  # until the replica has measured a load from that tier
DEFAULT_REDIS_RATIO = 0.15


class QueuedTokens:
    """Prompt tokens (router estimates) of the requests a replica has accepted and not finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = 0.0

    def add(self, tokens: float) -> None:
        with self._lock:
            self._tokens += tokens

    def done(self, tokens: float) -> None:
        with self._lock:
            self._tokens = max(0.0, self._tokens - tokens)

    @property
    def value(self) -> float:
        return self._tokens


def _ratio(engine: Engine, tier: str, default: float) -> float:
    ratio = engine.load_cost_ratio(tier)
    return default if ratio is None else min(1.0, ratio)


def held_chunk_keys(engine: Engine) -> tuple[set[str], set[str]]:
    """Routing keys of the chunk ids whose KV this replica holds in RAM, and on disk only. The
    store lists exactly the ids some local tier still holds; ids are already tenant-scoped by the
    server (server/tenancy.py), as the router's keys are."""
    ram, lower = engine.held_chunk_ids()
    ram_keys = {chunk_key(c) for c in ram}
    return ram_keys, {chunk_key(c) for c in lower} - ram_keys


def routing_stats(engine: Engine, queued: QueuedTokens, seq: int) -> dict[str, Any]:
    ram, disk = held_chunk_keys(engine)
    return {"version": STATS_VERSION, "seq": seq, "ram": sorted(ram), "disk": sorted(disk),
            "queued_tokens": queued.value, "redis": engine.health().redis_url is not None,
            "disk_ratio": _ratio(engine, "disk", DEFAULT_DISK_RATIO),
            "redis_ratio": _ratio(engine, "redis", DEFAULT_REDIS_RATIO)}


def request_work(engine: Engine, route: RouteInfo) -> float:
    """The prefill work (estimated computed tokens) a request brings this replica, by what it holds
    now: what the replica publishes as queued, in the router's units."""
    ram, disk = held_chunk_keys(engine)
    here = ReplicaView("self", frozenset(ram), frozenset(disk), disk_ratio=_ratio(engine, "disk", DEFAULT_DISK_RATIO))
    return missing_tokens(route, here, frozenset(), RouterParams()) + route.other_tokens
