"""`ragcache bench route-replay`: the cluster bench's stream replayed offline through the router's
own code (`routing.choose`, `RouterState`), against a model of the replicas: each holds one LRU
RAM tier of 1/N of the working set and serves its queue one request at a time, at a fixed cost
per computed token. No Ray and no model weights: seconds instead of `bench cluster`'s quarter of
an hour, so router settings can be compared on a stream before the best is measured for real.

The times are a model (closed-loop clients, instant residency reports); read the hit ratio,
computed tokens and load balance, and confirm with `ragcache bench cluster`.
"""

from __future__ import annotations

import argparse
import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from engine_sidecar.cluster.routing import (
    STATS_VERSION,
    HomeRing,
    RouteInfo,
    RouterParams,
    RouterState,
    choose,
    route_info_from_body,
)
from ragcache_lab.report import args_config, publish
from ragcache_lab.stream import Request, build_document_stream, build_per_document_stream, load_corpus
from ragcache_lab.tables import markdown_table


@dataclass
class ReplicaModel:
    """One replica: an LRU of chunk ids by token count, and when its queue is free."""

    name: str
    capacity_tokens: float
    held: OrderedDict[str, int] = field(default_factory=OrderedDict)  # chunk id -> tokens, oldest first
    used_tokens: int = 0
    free_at: float = 0.0

    def serve(self, chunk_ids: tuple[str, ...], tokens: dict[str, int]) -> tuple[int, int, int]:
        """(hits, misses, computed chunk tokens) of one request; misses are stored, LRU out."""
        hits = misses = computed = 0
        for cid in chunk_ids:
            if cid in self.held:
                hits += 1
                self.held.move_to_end(cid)
                continue
            misses += 1
            computed += tokens[cid]
            self.held[cid] = tokens[cid]
            self.used_tokens += tokens[cid]
            while self.used_tokens > self.capacity_tokens and len(self.held) > 1:
                _, size = self.held.popitem(last=False)
                self.used_tokens -= size
        return hits, misses, computed


@dataclass
class ReplayResult:
    router: str
    hits: int = 0
    misses: int = 0
    computed_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    requests: Counter[str] = field(default_factory=Counter)
    computed: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        def ratio(values: Any) -> float | None:
            values = list(values)
            return max(values) / min(values) if values and min(values) > 0 else None

        ordered = sorted(self.ttft_s)
        pick = (lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]) if ordered else None
        return {"router": self.router, "local_hit_ratio": self.hits / max(1, self.hits + self.misses),
                "computed_prefill_tokens": self.computed_tokens,
                "model_ttft_p50_s": pick(0.5) if pick else None, "model_ttft_p99_s": pick(0.99) if pick else None,
                "load_max_min_requests": ratio(self.requests.values()),
                "load_max_min_computed": ratio(self.computed.values()), "reasons": dict(self.reasons)}


def replay(stream: list[Request], texts: dict[str, str], tokens: dict[str, int], replicas: int, clients: int,
           router: str, params: RouterParams, question_tokens: int = 40, s_per_token: float = 0.0017,
           fixed_s: float = 0.3) -> ReplayResult:
    """Closed-loop clients send the stream in order; each request is routed (round robin, or the
    affinity router with `params`), then served by its replica after whatever it has queued."""
    capacity = sum(tokens[c] for c in {c for r in stream for c in r.chunk_ids}) / replicas
    models = [ReplicaModel(f"r{i}", capacity) for i in range(replicas)]
    result = ReplayResult(router)
    for m in models:
        result.requests[m.name] = result.computed[m.name] = 0
    state, ring = RouterState(decay=params.decay), HomeRing()
    routes = [route_info_from_body("/v1/generate", {"prompt": {
        "chunks": [{"id": c, "text": texts[c]} for c in r.chunk_ids], "question": r.question}}, None) for r in stream]
    key_of = {c: ref.key for r, route in zip(stream, routes, strict=True)
              for c, ref in zip(r.chunk_ids, route.chunks, strict=True)}
    clock: list[tuple[float, int, int]] = [(0.0, client, -1) for client in range(clients)]
    heapq.heapify(clock)
    sent = 0
    while clock:
        now, client, finished = heapq.heappop(clock)
        if finished >= 0:
            state.completed(str(finished))
        if sent >= len(stream):
            continue
        index, sent = sent, sent + 1
        model = _route(index, routes[index], models, key_of, state, ring, router, params, result)
        hits, misses, computed = model.serve(stream[index].chunk_ids, tokens)
        start = max(now, model.free_at)
        model.free_at = start + fixed_s + (computed + question_tokens) * s_per_token
        result.hits, result.misses = result.hits + hits, result.misses + misses
        result.computed_tokens += computed + question_tokens
        result.requests[model.name] += 1
        result.computed[model.name] += computed + question_tokens
        result.ttft_s.append(model.free_at - now)
        heapq.heappush(clock, (model.free_at, client, index))
    return result


def _route(index: int, route: RouteInfo, models: list[ReplicaModel], key_of: dict[str, str], state: RouterState,
           ring: HomeRing, router: str, params: RouterParams, result: ReplayResult) -> ReplicaModel:
    if router == "round-robin":
        result.reasons["round-robin"] += 1
        return models[index % len(models)]
    by_name = {m.name: m for m in models}
    views = [state.view(m.name, {"version": STATS_VERSION, "seq": index, "queued_tokens": 0.0,
                                 "ram": [key_of[c] for c in m.held]}) for m in models]
    decision = choose(route, views, ring, params)
    name = decision.ranked[0]
    state.routed(name, route, str(index), decision.work[name])
    result.reasons[decision.reason] += 1
    return by_name[name]


REPLAY_HEADER = ["router", "settings", "local hit ratio", "computed prefill tokens", "model TTFT p50 / p99 (s)",
                 "max/min load (requests)", "max/min load (computed)", "decisions"]


def replay_table(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    title = (f"`ragcache bench route-replay` (a model, not a measurement): {config['requests']} requests, "
             f"{config['documents']} documents, {config['retrieval']} retrieval, k={config['k']}, {config['replicas']} "
             f"replicas with 1/{config['replicas']} of the working set each, {config['clients']} clients")
    cells = [[r["router"], r.get("settings", ""), f"{r['local_hit_ratio']:.3f}", f"{r['computed_prefill_tokens']:,}",
              f"{f(r['model_ttft_p50_s'], '.2f')} / {f(r['model_ttft_p99_s'], '.2f')}",
              f(r["load_max_min_requests"], ".2f"), f(r["load_max_min_computed"], ".2f"),
              ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))] for r in rows]
    return "\n".join([title, "", markdown_table(REPLAY_HEADER, cells)])


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"ragcache bench route-replay: {flag} takes a comma list of numbers, got '{text}'") from None
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"ragcache bench route-replay: {flag} takes a comma list of numbers >= 0, got '{text}'")
    return values


def run_route_replay(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from engine_sidecar.model.prepare import resolve_model_dir

    console = Console(stderr=True)
    if args.requests < 1 or args.replicas < 1 or args.clients < 1:
        raise SystemExit("ragcache bench route-replay: --requests, --replicas and --clients must be at least 1")
    corpus = load_corpus(args.corpus)
    build = build_per_document_stream if args.retrieval == "per-document" else build_document_stream
    stream = build(corpus, args.requests, args.k, documents=args.documents, seed=args.seed)
    used = sorted({c for r in stream for c in r.chunk_ids})
    texts = {c: corpus.passages[c][: args.passage_chars] if args.passage_chars else corpus.passages[c] for c in used}
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    tokens = {c: len(tokenizer(texts[c], add_special_tokens=False)["input_ids"]) for c in used}
    rows = [{**replay(stream, texts, tokens, args.replicas, args.clients, "round-robin", RouterParams()).summary(),
             "settings": "-"}]
    for w in _floats(args.router_w, "--router-w"):
        for slack in _floats(args.router_slack, "--router-slack"):
            for per_request in _floats(args.router_slack_requests, "--router-slack-requests"):
                params = RouterParams(w=w, load_slack_tokens=slack, load_slack_requests=per_request)
                row = replay(stream, texts, tokens, args.replicas, args.clients, "affinity", params).summary()
                rows.append({**row, "settings": f"w {w:g}, slack {slack:g} / {per_request:g} requests"})
    config = {**args_config(args), "passages_used": len(used), "working_set_tokens": sum(tokens.values())}
    publish(console, args.json, {"config": config, "rows": rows}, replay_table(rows, config))
    return 0


def add_route_replay_arguments(p: argparse.ArgumentParser) -> None:
    from ragcache_lab.cluster import add_stream_arguments

    add_stream_arguments(p)
    p.add_argument("--replicas", type=int, default=3, help="replicas (default 3)")
    p.add_argument("--clients", type=int, default=3, help="closed-loop clients (default 3)")
    p.add_argument("--router-w", default=str(RouterParams.w), help="comma list of w to try (default the router's)")
    p.add_argument("--router-slack", default=str(RouterParams.load_slack_tokens),
                   help="comma list of the guard's least slack in tokens to try (default the router's)")
    p.add_argument("--router-slack-requests", default=str(RouterParams.load_slack_requests),
                   help="comma list of the guard's slack in the request's own prompts to try (default the router's)")
    p.add_argument("--model", default="default", help="model folder whose tokenizer counts tokens (default SmolLM2)")
    p.add_argument("--json", type=Path, default=None, help="write results JSON (and a .md table) here")
