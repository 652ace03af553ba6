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
    """Per-token cost of a full prefill, measured once on this engine (policy `full`)."""

    ms_per_token: float
    tokens: int
    ttft_s: float
    measured_at: float  # Unix seconds: the estimate is as fresh as this


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
        """Time one full prefill (best of two) to estimate what full prefill of a turn would cost."""
        from ragcache_integrations.langchain import ChunkCachedRunnable

        probe = ChunkCachedRunnable(**self.backend, policy="full", max_tokens=1, tenant="chatbot-calibration")
        best: FullPrefillCost | None = None
        for _ in range(2):
            probe.invoke({"input": "What does the passage describe?", "context": [_CALIBRATION_TEXT]})
            stats = probe.last_stats
            tokens = max(int(stats["prefill_tokens_total"]), 1)
            cost = FullPrefillCost(1000.0 * stats["ttft_s"] / tokens, tokens, stats["ttft_s"], time.time())
            best = cost if best is None or cost.ms_per_token < best.ms_per_token else best
        assert best is not None
        self.full_prefill = best
        return best

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
            "tokens_computed": stats.get("tokens_computed_fresh", 0),
            "chunk_hits": stats.get("chunk_hits", 0),
            "chunks": stats.get("chunk_hits", 0) + stats.get("chunk_misses", 0),
            "chunks_deduplicated": stats.get("chunks_deduplicated", 0),
            "policy": stats.get("policy", ""), "decode_tokens": stats.get("decode_tokens", 0),
            # "length": the answer was cut at --max-tokens (the page marks it)
            "finish_reason": stats.get("finish_reason", ""),
        }
        if self.full_prefill is not None:
            numbers["full_prefill_s"] = tokens * self.full_prefill.ms_per_token / 1000.0
            numbers["full_prefill_basis"] = "estimated"
            age_s = time.time() - self.full_prefill.measured_at
            numbers["full_prefill_note"] = (f"{tokens} tokens x {self.full_prefill.ms_per_token:.2f} ms/token "
                                            f"(a full prefill measured {age_s / 60:.0f} min ago, at start-up)")
        return numbers

    def describe(self) -> dict[str, Any]:
        return {"settings": asdict(self.settings),
                "full_prefill": asdict(self.full_prefill) if self.full_prefill else None,
                "sidecar": self.backend.get("base_url", "in-process engine")}
