"""Closed-loop streaming clients: each client sends a request, reads its streamed answer to the
end, then sends the next. Per level: TTFT (arrival to first streamed text), output tokens/s (all
clients' generated tokens over the level's wall time) and errors. Used by `ragcache bench load`
against sidecar processes and by `ragcache bench gpu` against an in-process server; it needs
httpx and pydantic only (no rich, no torch)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChatRequest:
    question: str
    passages: tuple[str, ...]

    def prompt(self) -> dict[str, Any]:
        return {"chunks": [{"text": p} for p in self.passages], "question": self.question}


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
        start = time.perf_counter()
        ttft = None
        sampling = {"max_tokens": self.max_tokens, "ignore_eos": self.ignore_eos}
        for delta in client.stream(request.prompt(), sampling, policy=self.policy):
            if ttft is None and delta:
                ttft = time.perf_counter() - start
        result = client.last_result
        tokens = result.usage.completion_tokens if result is not None else 0
        return (ttft if ttft is not None else time.perf_counter() - start), tokens



def run_level(system: str, target: Any, requests: list[ChatRequest], clients: int) -> LevelResult:
    """`clients` closed-loop clients share the request list (each takes the next one)."""
    out = LevelResult(system, clients)
    lock = threading.Lock()
    queue = list(reversed(requests))

    def client_loop() -> None:
        client = target.make_client()
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    request = queue.pop()
                try:
                    ttft, tokens = target.ask(client, request)
                except Exception as exc:  # noqa: BLE001 - a failed request is a result to report
                    with lock:
                        out.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    out.ttft_s.append(ttft)
                    out.output_tokens += tokens
                    out.requests += 1
        finally:
            if client is not None:
                client.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, name=f"load-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.wall_s = time.perf_counter() - started
    return out
