"""Open-loop load and the statistics of traced requests.

An open loop sends each request at its arrival time whether or not the earlier ones have finished,
as independent users do; arrivals are a Poisson process (exponential gaps). A request's TTFT
counts from its scheduled arrival, so a sender that falls behind its schedule shows up as latency
rather than as a quietly lighter load. Clients come from a pool that grows to the peak number in
flight, made ahead where they can be, so an httpx client's construction is not on a request's
clock. Needs httpx and pydantic only (no torch).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from ragcache_lab.closed_loop import ChatRequest, RequestTrace, quantile, traced

CLIENTS_AHEAD = 8  # made before the first arrival; more only when more requests are in flight


def poisson_arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """`count` arrival offsets (seconds from the start) of a Poisson process of `rate` per second."""
    at, out = 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        out.append(at)
    return out


def zipf_draw(rng: random.Random, population: int, count: int, s: float = 1.0) -> list[int]:
    """`count` distinct indices of `population`, index i drawn with weight 1 / (i + 1)^s (index 0
    the most popular), in a shuffled order: a retriever returns a request's passages in an order
    of its own, not by popularity."""
    if count > population:
        raise ValueError(f"cannot draw {count} distinct of {population}")
    left = list(range(population))
    weights = [1.0 / (i + 1) ** s for i in left]
    picked: list[int] = []
    for _ in range(count):
        j = rng.choices(range(len(left)), weights)[0]
        picked.append(left.pop(j))
        weights.pop(j)
    rng.shuffle(picked)
    return picked


class _ClientPool:
    def __init__(self, target: Any, ahead: int):
        self.target, self.lock = target, threading.Lock()
        self.free = [target.make_client() for _ in range(ahead)]
        self.made = list(self.free)

    def take(self) -> Any:
        with self.lock:
            if self.free:
                return self.free.pop()
        client = self.target.make_client()
        with self.lock:
            self.made.append(client)
        return client

    def give(self, client: Any) -> None:
        with self.lock:
            self.free.append(client)

    def close(self) -> None:
        for client in self.made:
            client.close()


def run_open(target: Any, requests: list[ChatRequest], offsets: list[float]) -> tuple[list[RequestTrace], float]:
    """Each request sent at its offset from the start on a thread of its own; every trace (failed
    ones too) and the wall seconds from the start to the last answer's end."""
    traces: list[RequestTrace | None] = [None] * len(requests)
    pool = _ClientPool(target, min(CLIENTS_AHEAD, len(requests)))

    def send(i: int, arrival: float) -> None:
        client = pool.take()
        try:
            traces[i] = traced(target, client, requests[i], arrival)
        finally:
            pool.give(client)

    threads: list[threading.Thread] = []
    start = time.perf_counter()
    try:
        for i, offset in enumerate(offsets):
            wait = start + offset - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            thread = threading.Thread(target=send, args=(i, start + offset), name=f"open-loop-{i}")
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
    finally:
        pool.close()
    return [t for t in traces if t is not None], time.perf_counter() - start


def row_stats(traces: list[RequestTrace], wall_s: float, timeout_s: float) -> dict[str, Any]:
    """What the clients saw of one row: latency quantiles, throughput, the time-averaged number of
    requests in flight (`mean_concurrency`: each answered request's arrival to end, over the wall;
    Little's law), the mean context a decode step reads (prompt + half the answer) and the chunk
    reuse the responses report."""
    done = [t for t in traces if t.error is None]
    failed = [t for t in traces if t.error is not None]
    ttft = [t.ttft_s for t in done]
    gaps = [g for t in done for g in t.token_gaps()]
    tokens = sum(t.tokens for t in done)
    lookups = sum(t.chunk_hits + t.chunk_misses for t in done)
    in_flight_s = sum(t.end - t.arrival for t in done)
    first_error = (failed[0].error or "")[:500] if failed else None  # a traceback-long message stays readable
    return {"requests": len(traces), "errors": len(failed), "first_error": first_error,
            "over_timeout": sum(1 for t in traces if t.end - t.arrival > timeout_s),
            "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "itl_p50_ms": _ms(quantile(gaps, 0.5)), "itl_p99_ms": _ms(quantile(gaps, 0.99)),
            "output_tokens": tokens, "wall_s": wall_s,
            "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "requests_per_s": len(done) / wall_s if wall_s else 0.0,
            "mean_concurrency": in_flight_s / wall_s if wall_s else 0.0,
            "mean_context_tokens": (sum(t.prompt_tokens + t.tokens / 2 for t in done) / len(done)) if done else 0.0,
            "prompt_tokens": sum(t.prompt_tokens for t in done),
            "tokens_reused": sum(t.tokens_reused for t in done),
            "chunk_hits": sum(t.chunk_hits for t in done), "chunk_lookups": lookups,
            "chunk_hit_ratio": sum(t.chunk_hits for t in done) / lookups if lookups else 0.0}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
