"""Chunk-affinity routing, as plain data and arithmetic (no Ray here: engine_sidecar/cluster/ray_app.py
is the thin glue that feeds this module Ray's replicas and their routing stats).

A replica publishes which chunks it holds (keys of tenant-scoped chunk ids, split by tier) and how
many prompt tokens it has queued. For one request the router scores every replica as

    score = w * prefill_tokens_missing(replica) + queued_tokens(replica)

where a chunk held in the replica's RAM costs ~0 of its tokens, one on its local disk (or in the
shared Redis tier) its measured load/compute ratio, and a miss all of them. Chunks are routed on
residency, not on text prefixes: RAG retrieves the same passages in new orders, and fusion reuses a
chunk wherever it lands in the prompt.

Ties, and requests whose chunks no replica has seen, go to the consistent-hash home of the request's
largest chunk, so the first replica to compute a chunk is the one the next request with it goes to.
An imbalance guard sends the request to the least loaded replica when the chosen one's load would be
more than `imbalance` times the smallest plus a slack of 1.5 requests of this size (a hot
document must not pin one replica while others idle, but a request more is not an imbalance).

Token counts are estimates from text length (the router never tokenizes: ~4 UTF-8 bytes per token
for the BPE tokenizers this engine serves); they only need to rank replicas.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_sidecar.server.tenancy import scope_id

if TYPE_CHECKING:
    from uhashring import HashRing

BYTES_PER_TOKEN = 4  # rough, for ranking only
STATS_VERSION = 1


def chunk_key(scoped_chunk_id: str) -> str:
    """The routing key of a chunk id already scoped to its tenant (what the engine stores under).
    8 bytes: compact enough to publish thousands per replica, and a collision only costs a guess."""
    return hashlib.blake2b(scoped_chunk_id.encode("utf-8"), digest_size=8).hexdigest()


def estimate_tokens(text: str) -> int:
    return max(1, len(text.encode("utf-8")) // BYTES_PER_TOKEN)


@dataclass(frozen=True)
class ChunkRef:
    key: str
    tokens: int


@dataclass(frozen=True)
class RouteInfo:
    """What the router knows about one request: its chunks and the rest of its prompt (always computed)."""

    chunks: tuple[ChunkRef, ...] = ()
    other_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.other_tokens + sum(c.tokens for c in self.chunks)

    def largest(self) -> ChunkRef | None:
        # ties broken by key, so every router picks the same chunk
        return max(self.chunks, key=lambda c: (c.tokens, c.key), default=None)

    def to_wire(self) -> dict[str, Any]:
        return {"chunks": [[c.key, c.tokens] for c in self.chunks], "other_tokens": self.other_tokens}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any] | None) -> RouteInfo:
        if not data:
            return cls()
        return cls(tuple(ChunkRef(str(k), int(t)) for k, t in data.get("chunks", ())), int(data.get("other_tokens", 0)))


def _chunk_fields(chunk: Any) -> tuple[str | None, str]:
    if isinstance(chunk, str):
        return None, chunk
    if isinstance(chunk, Mapping):
        return (chunk.get("id") or None), str(chunk.get("text", ""))
    return None, ""


def route_info_from_body(path: str, body: Mapping[str, Any], header_tenant: str | None) -> RouteInfo:
    """RouteInfo of a native `/v1/generate` or `/v1/chunks/warm`, or an OpenAI chat request with
    `chunks`, read from its JSON body without validating it (the replica validates; a body this
    cannot read routes as a request without chunks)."""
    from ragcache_integrations.types import chunk_id_for

    tenant = body.get("tenant") or header_tenant or ""
    if not isinstance(tenant, str):
        tenant = ""
    other = 0
    if path.endswith("/v1/generate"):
        prompt = body.get("prompt") or {}
        chunks = prompt.get("chunks") or [] if isinstance(prompt, Mapping) else []
        if isinstance(prompt, Mapping):
            other = sum(estimate_tokens(str(prompt.get(k) or "")) for k in ("system", "question"))
    else:
        chunks = body.get("chunks") or []
        messages = body.get("messages") or []
        if isinstance(messages, list):
            other = sum(estimate_tokens(str(m.get("content") or "")) for m in messages if isinstance(m, Mapping))
    refs = []
    for chunk in chunks if isinstance(chunks, list) else []:
        cid, text = _chunk_fields(chunk)
        if not text:
            continue
        refs.append(ChunkRef(chunk_key(scope_id(cid or chunk_id_for(text), tenant)), estimate_tokens(text)))
    return RouteInfo(tuple(refs), other)


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it: its published stats plus what this router sent it since."""

    name: str
    ram: frozenset[str] = frozenset()
    disk: frozenset[str] = frozenset()
    queued_tokens: float = 0.0  # prefill work (estimated computed tokens) accepted and not finished
    recent_tokens: float = 0.0  # work this router sent it lately (decayed): the guard's memory
    disk_ratio: float = 0.1  # load/compute per token, measured by the replica when it has seen a load
    redis_ratio: float = 0.15
    redis: bool = False  # the replica reads the shared Redis tier

    @classmethod
    def from_stats(cls, name: str, stats: Mapping[str, Any] | None) -> ReplicaView:
        """From a replica's `record_routing_stats()` dict; a replica without stats yet holds nothing."""
        if not stats or stats.get("version") != STATS_VERSION:
            return cls(name)
        return cls(name, frozenset(stats.get("ram", ())), frozenset(stats.get("disk", ())),
                   float(stats.get("queued_tokens", 0.0)), float(stats.get("disk_ratio", 0.1)),
                   float(stats.get("redis_ratio", 0.15)), bool(stats.get("redis", False)))


@dataclass(frozen=True)
class RouterParams:
    # weight of missing prefill tokens against queued ones: a missing token is computed by a
    # replica that shares the machine's cores, a queued one only waits; `ragcache bench cluster`
    # measured w=4 ahead of w=1 (docs/benchmarks.md, run 3)
    w: float = 4.0
    ram_cost: float = 0.0  # a RAM hit's cost per token (copy and rotate: ~0 next to compute)
    imbalance: float = 1.5  # the guard: chosen load > imbalance x smallest load + slack -> least loaded
    # the guard's slack, about one request's prompt: with a few requests in flight, one request
    # more on the best replica is not an imbalance (without it an idle replica, load 0, would
    # take every request that arrives while the chunks' replica is busy, and affinity would be gone)
    load_slack_tokens: float = 1024.0
    # ... and at least this many of the request's own prompts (its estimated tokens): a fixed
    # slack below one request's size let the guard scatter a document's chunks over every
    # replica while they were first computed, and the router never gathered them again; 1.5
    # measured ahead of 1 on both cluster-bench streams, balance kept (docs/benchmarks.md)
    load_slack_requests: float = 1.5
    decay: float = 0.9  # recent work is multiplied by this at every routed request (~10-request memory)


@dataclass(frozen=True)
class Decision:
    ranked: tuple[str, ...]  # best first: Ray tries the next one when the first is full or gone
    reason: str  # "affinity" | "home" | "tie-home" | "imbalance" | "no-chunks"
    scores: dict[str, float] = field(default_factory=dict)
    work: dict[str, float] = field(default_factory=dict)  # estimated computed tokens on each replica


def chunk_cost(key: str, replica: ReplicaView, shared: frozenset[str], params: RouterParams) -> float:
    """Fraction of a chunk's tokens the replica would compute (or pay as load) to use it."""
    if key in replica.ram:
        return params.ram_cost
    if key in replica.disk:
        return replica.disk_ratio
    if replica.redis and key in shared:  # computed somewhere, so written to the shared tier
        return replica.redis_ratio
    return 1.0


def missing_tokens(route: RouteInfo, replica: ReplicaView, shared: frozenset[str], params: RouterParams) -> float:
    """Prefill tokens the replica would pay for the request's chunks (the question and system
    prompt cost the same everywhere, so they are left out of the comparison)."""
    return sum(c.tokens * chunk_cost(c.key, replica, shared, params) for c in route.chunks)


class HomeRing:
    """Consistent-hash homes over replica names (uhashring: adding or losing a replica moves only
    the keys that hashed to it)."""

    def __init__(self) -> None:
        self._names: frozenset[str] = frozenset()
        self._ring: HashRing | None = None

    def order(self, names: Iterable[str], key: str) -> list[str]:
        """All names, starting at the key's home and going round the ring."""
        names = frozenset(names)
        if names != self._names:
            self._names = names
            from uhashring import HashRing  # the cluster extra's: imported when replicas run, not by the CLI

            self._ring = HashRing(nodes=sorted(names)) if names else None
        if self._ring is None:
            return []
        seen: list[str] = []
        for node in self._ring.range(key, unique=True):
            name = node["nodename"] if isinstance(node, dict) else str(node)
            if name not in seen:
                seen.append(name)
        return seen + sorted(names - set(seen))


def choose(route: RouteInfo, replicas: list[ReplicaView], ring: HomeRing,
           params: RouterParams = RouterParams()) -> Decision:
    """Rank replicas for one request (see the module docstring)."""
    if not replicas:
        return Decision((), "no-replicas")
    names = [r.name for r in replicas]
    shared = frozenset().union(*(r.ram | r.disk for r in replicas))
    missing = {r.name: missing_tokens(route, r, shared, params) for r in replicas}
    scores = {r.name: params.w * missing[r.name] + r.queued_tokens for r in replicas}
    work = {name: m + route.other_tokens for name, m in missing.items()}
    largest = route.largest()
    # ring order from the largest chunk's home: the tie-break everywhere below
    ring_order = ring.order(names, largest.key if largest is not None else "")
    rank_of = {name: i for i, name in enumerate(ring_order)}
    loads = {r.name: r.queued_tokens + r.recent_tokens for r in replicas}

    if largest is None:
        chosen, reason = min(names, key=lambda n: (loads[n], rank_of[n])), "no-chunks"
    elif not any(c.key in shared for c in route.chunks):
        chosen, reason = ring_order[0], "home"
    else:
        best = min(scores.values())
        tied = [n for n in names if math.isclose(scores[n], best, rel_tol=1e-9, abs_tol=0.5)]
        chosen = min(tied, key=lambda n: rank_of[n])
        reason = "tie-home" if len(tied) > 1 else "affinity"
    least = min(names, key=lambda n: (loads[n], scores[n], rank_of[n]))
    slack = max(params.load_slack_tokens, params.load_slack_requests * route.tokens)
    if loads[chosen] > params.imbalance * loads[least] + slack:
        chosen, reason = least, "imbalance"
    rest = sorted((n for n in names if n != chosen), key=lambda n: (scores[n], rank_of[n]))
    return Decision((chosen, *rest), reason, scores, work)


@dataclass
class RouterState:
    """What one router knows beyond the replicas' published stats (which arrive every few hundred
    ms): the requests it sent that have not completed (their tokens are queued there now), and the
    chunks its requests will leave on each replica. The chunk guess resets when the replica
    publishes a newer snapshot: its own list is the truth (a chunk it evicted or lost in a restart
    disappears there, and a request sent there anyway misses and computes it again)."""

    in_flight: dict[str, tuple[str, float]] = field(default_factory=dict)  # request id -> (replica, work)
    sent_chunks: dict[str, set[str]] = field(default_factory=dict)
    seen_seq: dict[str, int] = field(default_factory=dict)
    recent: dict[str, float] = field(default_factory=dict)  # decayed work sent to each replica
    decay: float = 0.9
    # chosen but not yet sent: request id -> (replica, work, when). Ray probes replicas between
    # choosing and sending, so requests arriving together were all chosen against the same empty
    # state and piled onto one replica; counting a choice at once prevents that. Entries of
    # requests never sent (cancelled) stop counting after `pending_ttl_s`.
    pending: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    pending_ttl_s: float = 5.0

    def view(self, name: str, stats: Mapping[str, Any] | None, now: float | None = None) -> ReplicaView:
        base = ReplicaView.from_stats(name, stats)
        seq = int(stats.get("seq", -1)) if stats else -1
        if self.seen_seq.get(name) != seq:
            self.seen_seq[name] = seq
            self.sent_chunks.pop(name, None)
        extra = self.sent_chunks.get(name)
        now = time.monotonic() if now is None else now
        mine = sum(tokens for replica, tokens in self.in_flight.values() if replica == name)
        mine += sum(work for replica, work, when in self.pending.values()
                    if replica == name and now - when < self.pending_ttl_s)
        # the replica's count includes other routers' requests; ours is current to the moment
        return ReplicaView(base.name, base.ram | extra if extra else base.ram, base.disk,
                           max(base.queued_tokens, mine), self.recent.get(name, 0.0), base.disk_ratio,
                           base.redis_ratio, base.redis)

    def chosen(self, name: str, route: RouteInfo, request_id: str, work: float, now: float | None = None) -> None:
        """The router picked `name` first for this request; Ray has not sent it yet."""
        self.pending[request_id] = (name, float(work), time.monotonic() if now is None else now)
        if len(self.pending) > 10_000:  # only cancelled requests' entries can pile up
            self.pending.clear()

    def routed(self, name: str, route: RouteInfo, request_id: str, work: float | None = None) -> None:
        """`work`: the request's estimated computed tokens there (all its tokens when unknown)."""
        self.pending.pop(request_id, None)
        work = float(route.tokens if work is None else work)
        self.in_flight[request_id] = (name, work)
        self.sent_chunks.setdefault(name, set()).update(c.key for c in route.chunks)
        for replica in self.recent:
            self.recent[replica] *= self.decay
        self.recent[name] = self.recent.get(name, 0.0) + work

    def completed(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        self.pending.pop(request_id, None)

    def forget(self, name: str) -> None:
        for table in (self.sent_chunks, self.seen_seq, self.recent):
            table.pop(name, None)
        for request_id in [r for r, (replica, _) in self.in_flight.items() if replica == name]:
            del self.in_flight[request_id]
        for request_id in [r for r, (replica, _, _) in self.pending.items() if replica == name]:
            del self.pending[request_id]
