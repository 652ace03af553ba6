"""The token ids a request becomes with `--engine vllm`, and what the sidecar remembers between
requests to lay the next ones out well.

ragcache's connector supplies KV only for a prompt that is exactly ragcache's layout of the
chunk structure it is sent with (PromptBuilder), and only for the leading run of chunks it
holds: the order decides how much it can supply. The chunk store lives in vLLM's process, so
`hits-first` / `misses-first` go by what this sidecar has sent before (per tenant, by content),
a proxy for what the connector holds (it may have evicted some: those are computed by vLLM, in
context). A conversation's follow-up turn is its history (earlier prompt and answer tokens) and
the new turn, sent as a plain vLLM request: vLLM's prefix cache holds the history, and it is
not a layout the connector could supply."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from engine_sidecar.request.prompt import PromptBuilder, segment_digest
from engine_sidecar.request.reorder import ChunkAccessTable, access_key, check_order
from ragcache_integrations.types import Chunk, ChunkedPrompt


@dataclass
class Laid:
    """One request for vLLM: `token_ids`, and the prompt the connector gets (None: plain vLLM)."""

    token_ids: list[int]
    prompt: ChunkedPrompt | None
    tenant: str
    chunk_digests: set[str] = field(default_factory=set)
    conversation: tuple[str, str] | None = None  # (tenant, conversation id) to extend after the answer
    known: set[str] = field(default_factory=set)  # chunk digests the conversation held before this turn
    history: int = 0  # tokens of earlier turns at the front of token_ids


class _Lru(OrderedDict):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def touch(self, key: object, value: object = None) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class VllmLayout:
    def __init__(self, builder: PromptBuilder, max_conversations: int = 64, max_chunks_seen: int = 100_000):
        self.builder = builder
        self._lock = threading.Lock()  # requests are laid out on several worker threads
        self._access = ChunkAccessTable()
        self._seen = _Lru(max_chunks_seen)  # (tenant, chunk digest) sent before
        self._talks = _Lru(max_conversations)  # (tenant, conversation id) -> (token ids, chunk digests)

    @property
    def conversations(self) -> int:
        return len(self._talks)

    def arrange(self, prompt: ChunkedPrompt, tenant: str, order: str) -> ChunkedPrompt:
        """The chunks in the requested order (as the engine's RequestPreparer does)."""
        check_order(order)
        with self._lock:
            self._access.record([access_key(tenant, c.id or "") for c in prompt.chunks])
            if not prompt.chunks or prompt.messages is not None or order == "preserve":
                return prompt  # a verbatim prompt's chunks sit where the app's text put them
            if order == "frequency":
                chunks = self._access.sort(prompt.chunks, lambda c: access_key(tenant, c.id or ""))
            else:
                held = [self._held(c, tenant) for c in prompt.chunks]
                old = [c for c, h in zip(prompt.chunks, held, strict=True) if h]
                new = [c for c, h in zip(prompt.chunks, held, strict=True) if not h]
                chunks = old + new if order == "hits-first" else new + old
        return prompt.model_copy(update={"chunks": chunks})

    def _held(self, chunk: Chunk, tenant: str) -> bool:
        return (tenant, segment_digest(self.builder.chunk_segment(chunk))) in self._seen

    def lay_out(self, prompt: ChunkedPrompt, tenant: str) -> Laid:
        talk = (tenant, prompt.conversation_id) if prompt.conversation_id and prompt.messages is None else None
        with self._lock:
            history = self._talks.get(talk) if talk is not None else None
        if history is None:
            assembled = self.builder.build(prompt)
            digests = {segment_digest(s) for s in assembled.segments if s.kind == "chunk"}
            return Laid(assembled.token_ids, prompt, tenant, digests, talk)
        ids, known = history
        turn = self.builder.build_followup(prompt, known)
        digests = {segment_digest(s) for s in turn.segments if s.kind == "chunk"}
        return Laid(ids + turn.token_ids, None, tenant, digests, talk, known, len(ids))

    def remember(self, laid: Laid, answer_ids: list[int]) -> None:
        """After a completed request: its chunks count as sent, its conversation grows."""
        with self._lock:
            if laid.prompt is not None:
                for digest in laid.chunk_digests:
                    self._seen.touch((laid.tenant, digest))
            if laid.conversation is not None:
                self._talks.touch(laid.conversation, (laid.token_ids + answer_ids, laid.known | laid.chunk_digests))
