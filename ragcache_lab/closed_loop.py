"""Closed-loop streaming clients: each client sends a request, reads its streamed answer to the
end, then sends the next. Per level: TTFT (arrival to first streamed text), output tokens/s (all
clients' generated tokens over the level's wall time) and errors. Used by `ragcache bench load`
against sidecar processes and by `ragcache bench gpu` against an in-process server; it needs
httpx and pydantic only (no rich, no torch).

`run_traced` is the same loop keeping each request's whole timeline (`RequestTrace`: arrival,
every streamed text event, what the response's usage and stats said), for statistics a level's
summary cannot give (inter-token latency, the KV the running requests held)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChatRequest:
    question: str
    passages: tuple[str, ...]
    max_tokens: int | None = None  # the target's own when None

    def prompt(self) -> dict[str, Any]:
        return {"chunks": [{"text": p} for p in self.passages], "question": self.question}


@dataclass
class RequestTrace:
    """One streamed request as its client saw it (perf_counter seconds)."""

    arrival: float
    max_tokens: int = 0
    events: list[float] = field(default_factory=list)  # each streamed text event's arrival
    end: float = 0.0
    tokens: int = 0  # usage.completion_tokens
    prompt_tokens: int = 0
    tokens_reused: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return (self.events[0] if self.events else self.end) - self.arrival

    def token_gaps(self) -> list[float]:
        """Seconds between streamed tokens. An event carries one token's text, or several when
        a token's text was held back (an incomplete UTF-8 character) or a token added none; the
        stream does not say how many, so each gap between events is divided by the request's
        mean tokens per event after the first: (tokens - 1) / (events - 1), exact whenever every
        token brought text of its own."""
        if len(self.events) < 2 or self.tokens < 2:
            return []
        per_event = max(1.0, (self.tokens - 1) / (len(self.events) - 1))
        return [(b - a) / per_event for a, b in zip(self.events, self.events[1:], strict=False)]


@dataclass
class LevelResult:
    system: str
    clients: int
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"system": self.system, "clients": self.clients, "requests": self.requests,
                "errors": len(self.errors), "first_errors": self.errors[:3],
                "ttft_p50_s": quantile(self.ttft_s, 0.5), "ttft_p99_s": quantile(self.ttft_s, 0.99),
                "output_tokens": self.output_tokens, "wall_s": self.wall_s,
                "output_tokens_per_s": self.output_tokens / self.wall_s if self.wall_s else 0.0}


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]



class RagcacheTarget:
    def __init__(self, base: str, max_tokens: int, policy: str, ignore_eos: bool = False):
        from ragcache_integrations.client import RagCacheClient

        self.make_client = lambda: RagCacheClient(base, timeout=600, retries=0)
        self.max_tokens, self.policy, self.ignore_eos = max_tokens, policy, ignore_eos

    def ask(self, client: Any, request: ChatRequest) -> tuple[float, int]:
        trace = self.trace(client, request, time.perf_counter())
        return trace.ttft_s, trace.tokens

    def trace(self, client: Any, request: ChatRequest, arrival: float) -> RequestTrace:
        """Stream `request`'s answer; `arrival` is when it counts as asked (an open loop's
        schedule, which may be earlier than the send). A failure raises."""
        out = RequestTrace(arrival, max_tokens=request.max_tokens or self.max_tokens)
        sampling = {"max_tokens": out.max_tokens, "ignore_eos": self.ignore_eos}
        for delta in client.stream(request.prompt(), sampling, policy=self.policy):
            if delta:
                out.events.append(time.perf_counter())
        out.end = time.perf_counter()
        result = client.last_result
        if result is not None:
            out.tokens, out.prompt_tokens = result.usage.completion_tokens, result.usage.prompt_tokens
            stats = result.stats
            out.tokens_reused, out.chunk_hits, out.chunk_misses = stats.tokens_reused, stats.chunk_hits, \
                stats.chunk_misses
        return out


def traced(target: Any, client: Any, request: ChatRequest, arrival: float) -> RequestTrace:
    """`target.trace`, a failure recorded in the trace rather than raised (it is a result)."""
    try:
        return target.trace(client, request, arrival)
    except Exception as exc:  # noqa: BLE001 - a failed request is a result to report
        return RequestTrace(arrival, max_tokens=request.max_tokens or 0, end=time.perf_counter(),
                            error=f"{type(exc).__name__}: {exc}")


def run_level(system: str, target: Any, requests: list[ChatRequest], clients: int) -> LevelResult:
    """`clients` closed-loop clients share the request list (each takes the next one)."""
    out = LevelResult(system, clients)
    lock = threading.Lock()

    def one(client: Any, request: ChatRequest) -> None:
        try:
            ttft, tokens = target.ask(client, request)
        except Exception as exc:  # noqa: BLE001 - a failed request is a result to report
            with lock:
                out.errors.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            out.ttft_s.append(ttft)
            out.output_tokens += tokens
            out.requests += 1

    out.wall_s = _closed_loop(target, requests, clients, one)
    return out


def run_traced(target: Any, requests: list[ChatRequest], clients: int) -> tuple[list[RequestTrace], float]:
    """`run_level` keeping every request's trace (failed ones too); and the level's wall seconds."""
    traces: list[RequestTrace] = []
    lock = threading.Lock()

    def one(client: Any, request: ChatRequest) -> None:
        trace = traced(target, client, request, time.perf_counter())
        with lock:
            traces.append(trace)

    wall = _closed_loop(target, requests, clients, one)
    return traces, wall


def _closed_loop(target: Any, requests: list[ChatRequest], clients: int,
                 one: Callable[[Any, ChatRequest], None]) -> float:
    """`clients` threads, each with a client of its own, take the next request and run `one` on it
    until none is left; the wall seconds from the first start to the last end."""
    lock = threading.Lock()
    queue = list(reversed(requests))

    def client_loop(client: Any) -> None:
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    request = queue.pop()
                one(client, request)
        finally:
            if client is not None:
                client.close()

    # made before the clock starts: a client's construction (an httpx client builds an SSL
    # context) is no request's latency
    made = [target.make_client() for _ in range(clients)]
    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,), name=f"load-client-{i}") for i, c in enumerate(made)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started
