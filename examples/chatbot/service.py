"""One chat turn as a stream of plain events, shared by the web page and `make demo`:
retrieve from Qdrant, answer through ragcache's LangChain adapter (one runnable per conversation,
so every turn continues from the previous turn's KV), then report what the turn cost and what
full prefill would have cost."""

from __future__ import annotations

import asyncio
import copy
import re
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from examples.chatbot.chat import SYSTEM, make_retriever
from ragcache_integrations.policy_registry import DEFAULT_POLICY

MAX_CONVERSATIONS = 1000  # per page process; the least recently used is forgotten first
# A follow-up ("Which novels is it based on?") names its topic only through the turns before it,
# so it is retrieved with the conversation's last questions before it (history-aware retrieval,
# without a model call: a small model's rewrite of the question is less reliable than the words)
RETRIEVAL_HISTORY = 2
CONVERSATION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# The calibration passage for the per-token prefill cost: unrelated to any ingested text, so
# measuring it neither warms nor pollutes the chunk cache the chat uses.
_CALIBRATION_TEXT = " ".join(
    f"Calibration paragraph {i}: the quick brown fox jumps over the lazy dog near river bank number {i}."
    for i in range(24)
)


@dataclass(frozen=True)
class ChatSettings:
    k: int = 3
    policy: str = DEFAULT_POLICY
    max_tokens: int = 64
    system: str = SYSTEM


@dataclass(frozen=True)
class FullPrefillCost:
    """What a full prefill of n tokens costs on this engine: a·n + b·n² milliseconds, fitted to
    full prefills (policy `full`) of a short and a long calibration prompt. Attention makes long
    prompts cost more than linear, so a per-token rate from one short prompt reads low for the
    ~2K-token prompts of a RAG turn."""

    ms_per_token: float  # a: the linear part (weights, MLP)
    ms_per_token_squared: float  # b: the part growing with the length (attention), >= 0
    tokens: tuple[int, int]  # the calibration prompts' lengths
    ttft_s: tuple[float, float]  # their measured TTFTs
    measured_at: float  # Unix seconds: the estimate is as fresh as this

    @classmethod
    def fit(cls, short: tuple[int, float], long: tuple[int, float], measured_at: float) -> FullPrefillCost:
        """The curve through two (tokens, seconds) measurements; where noise makes one coefficient
        negative, the other alone through the longer measurement (never an estimate below zero)."""
        (n1, t1), (n2, t2) = sorted([short, long])
        r1, r2 = 1000.0 * t1 / max(n1, 1), 1000.0 * t2 / max(n2, 1)
        b = (r2 - r1) / (n2 - n1) if n2 > n1 else 0.0
        a = r1 - b * n1
        if b < 0:
            a, b = r2, 0.0
        elif a < 0:
            a, b = 0.0, r2 / max(n2, 1)
        return cls(a, b, (n1, n2), (t1, t2), measured_at)

    def estimate_s(self, tokens: int) -> float:
        return (self.ms_per_token * tokens + self.ms_per_token_squared * tokens * tokens) / 1000.0


class ChatService:
    """Answers questions for many conversations; turns within one conversation run one at a time."""

    def __init__(self, client: Any, embed_model: Any, backend: dict[str, Any], settings: ChatSettings):
        from examples.chatbot.ingest import COLLECTION

        if not client.collection_exists(COLLECTION) or client.count(COLLECTION).count == 0:
            raise ValueError("the Qdrant collection is empty; run `python -m examples.chatbot.ingest` first "
                             "(with the same --qdrant-path / --qdrant-url)")
        self.client = client
        self.backend = backend  # {"engine": Engine} or {"base_url": str}
        self.settings = settings
        self.retriever = make_retriever(client, embed_model, settings.k)
        self.full_prefill: FullPrefillCost | None = None
        # one runnable (and one HTTP client) for all conversations; each conversation gets a
        # shallow copy that shares the backend and keeps its own id and last stats
        from ragcache_integrations.langchain import ChunkCachedRunnable

        self._template = ChunkCachedRunnable(**backend, system=settings.system, policy=settings.policy,
                                             max_tokens=settings.max_tokens)
        self._runnables: OrderedDict[str, Any] = OrderedDict()
        self._turn_locks: dict[str, asyncio.Lock] = {}
        self._turns: dict[str, int] = {}
        self._questions: dict[str, list[str]] = {}  # each conversation's last questions, for retrieval
        self._retrieve_lock = threading.Lock()  # Qdrant local mode is one client on one folder

    def _runnable(self, conversation_id: str) -> Any:
        runnable = self._runnables.get(conversation_id)
        if runnable is None:
            runnable = copy.copy(self._template)
            runnable.conversation_id, runnable.last_stats = conversation_id, {}
            self._runnables[conversation_id] = runnable
            while len(self._runnables) > MAX_CONVERSATIONS:  # the engine forgets idle ones too (TTL)
                oldest, _ = self._runnables.popitem(last=False)
                self._turns.pop(oldest, None)
                self._turn_locks.pop(oldest, None)
                self._questions.pop(oldest, None)
        self._runnables.move_to_end(conversation_id)
        return runnable

    def measure_full_prefill(self) -> FullPrefillCost:
        """Time full prefills of a short and a long calibration prompt (best of two for the short
        one, whose first run also warms the engine up) and fit the cost curve through them."""
        from ragcache_integrations.langchain import ChunkCachedRunnable

        probe = ChunkCachedRunnable(**self.backend, policy="full", max_tokens=1, tenant="chatbot-calibration")

        def timed(paragraphs: list[str]) -> tuple[int, float]:
            probe.invoke({"input": "What does the passage describe?", "context": paragraphs})
            stats = probe.last_stats
            return max(int(stats["prefill_tokens_total"]), 1), float(stats["ttft_s"])

        short = min((timed([_CALIBRATION_TEXT]) for _ in range(2)), key=lambda m: m[1] / m[0])
        long = timed([_CALIBRATION_TEXT.replace("Calibration", f"Calibration {part}") for part in "ABCD"])
        self.full_prefill = FullPrefillCost.fit(short, long, time.time())
        return self.full_prefill

    def retrieve(self, question: str) -> list[Any]:
        with self._retrieve_lock:
            return self.retriever.invoke(question)

    def retrieval_query(self, conversation_id: str, question: str) -> str:
        """The question, after the conversation's last questions: what retrieval searches for."""
        return " ".join([*self._questions.get(conversation_id, [])[-RETRIEVAL_HISTORY:], question])

    async def turn(self, conversation_id: str, question: str) -> AsyncIterator[dict[str, Any]]:
        """Events: `sources`, then `delta`s, then `stats` (the turn's numbers)."""
        if not CONVERSATION_ID.match(conversation_id):
            raise ValueError("conversation_id must be 1-64 characters of letters, digits, '_', '.', ':' or '-'")
        if not question.strip():
            raise ValueError("the question is empty")
        lock = self._turn_locks.setdefault(conversation_id, asyncio.Lock())
        async with lock:
            started = time.perf_counter()
            query = self.retrieval_query(conversation_id, question)
            docs = await asyncio.to_thread(self.retrieve, query)
            retrieval_s = time.perf_counter() - started
            self._questions.setdefault(conversation_id, []).append(question)
            yield {"type": "sources", "query": query, "sources": [
                {"id": d.id, "doc_id": d.metadata.get("doc_id"), "score": round(float(d.metadata.get("score", 0)), 4),
                 "text": d.page_content} for d in docs]}
            runnable = self._runnable(conversation_id)
            async for delta in runnable.astream({"input": question, "context": docs}):
                yield {"type": "delta", "text": delta}
            self._turns[conversation_id] = self._turns.get(conversation_id, 0) + 1
            yield {"type": "stats", **self.turn_numbers(runnable.last_stats, self._turns[conversation_id],
                                                         retrieval_s)}

    def turn_numbers(self, stats: dict[str, Any], turn: int, retrieval_s: float) -> dict[str, Any]:
        tokens = int(stats.get("prefill_tokens_total", 0))
        numbers = {
            "turn": turn, "ttft_s": stats.get("ttft_s", 0.0), "retrieval_s": retrieval_s,
            "prefill_tokens": tokens, "tokens_reused": stats.get("tokens_reused", 0),
            "tokens_recomputed": stats.get("tokens_recomputed", 0),
            # reused tokens of passages placed at new positions (fusion), not continued from a prefix
            "tokens_fused": stats.get("tokens_fused", 0),
            "tokens_computed": stats.get("tokens_computed_fresh", 0),
            "chunk_hits": stats.get("chunk_hits", 0),
            "chunks": stats.get("chunk_hits", 0) + stats.get("chunk_misses", 0),
            "chunks_deduplicated": stats.get("chunks_deduplicated", 0),
            "policy": stats.get("policy", ""), "decode_tokens": stats.get("decode_tokens", 0),
            # "length": the answer was cut at --max-tokens (the page marks it)
            "finish_reason": stats.get("finish_reason", ""),
        }
        cost = self.full_prefill
        if cost is not None:
            numbers["full_prefill_s"] = cost.estimate_s(tokens)
            numbers["full_prefill_basis"] = "estimated"
            age_s = time.time() - cost.measured_at
            numbers["full_prefill_note"] = (f"{tokens} tokens on the cost curve fitted to full prefills of "
                                            f"{cost.tokens[0]} and {cost.tokens[1]} tokens "
                                            f"({cost.ttft_s[0]:.2f}s, {cost.ttft_s[1]:.2f}s), measured "
                                            f"{age_s / 60:.0f} min ago, at start-up")
        return numbers

    def describe(self) -> dict[str, Any]:
        return {"settings": asdict(self.settings),
                "full_prefill": asdict(self.full_prefill) if self.full_prefill else None,
                "sidecar": self.backend.get("base_url", "in-process engine")}
