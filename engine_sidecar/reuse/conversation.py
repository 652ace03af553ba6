"""Conversation KV: a conversation's history (every prompt and answer token so far) kept so the
next turn continues from it instead of prefilling it again. Bounded by a TTL, a per-conversation
token budget and a count; whatever passes a bound is dropped whole (the next turn then starts
over with its own chunks), never half-kept."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_sidecar.store.entry import ChunkKV


@dataclass
class Conversation:
    tenant: str
    conversation_id: str
    system: str
    history: ChunkKV  # prompt + answer tokens of all turns so far, exact KV at positions 0..n-1
    chunk_digests: set[str] = field(default_factory=set)  # token digests of the chunks it holds
    turns: int = 1
    last_used: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return self.history.num_tokens


class ConversationStore:
    """Kept conversations, least recently used first out when over the count or the byte budget
    (the KV of every kept history together: it is not part of the chunk store's RAM tier)."""

    def __init__(self, ttl_s: float = 900.0, max_tokens: int = 4096, max_conversations: int = 64,
                 max_bytes: int = 512 << 20, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.max_conversations = max_conversations
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], Conversation] = OrderedDict()
        # bytes each kept conversation was counted as: removal subtracts exactly that, even if
        # someone replaced its history meanwhile
        self._sizes: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self.evicted = 0
        self.bytes = 0

    def _remove(self, key: tuple[str, str]) -> Conversation | None:
        conv = self._items.pop(key, None)
        if conv is not None:
            self.bytes -= self._sizes.pop(key)
        return conv

    def _expire(self, now: float) -> None:
        for key in [k for k, c in self._items.items() if now - c.last_used > self.ttl_s]:
            self._remove(key)
            self.evicted += 1

    def get(self, tenant: str, conversation_id: str) -> Conversation | None:
        now = self.clock()
        with self._lock:
            self._expire(now)
            conv = self._items.get((tenant, conversation_id))
            if conv is not None:
                # a read is a use: the TTL and the LRU order agree on what was used last
                conv.last_used = now
                self._items.move_to_end((tenant, conversation_id))
            return conv

    def put(self, conv: Conversation) -> bool:
        """Keep the conversation unless it is over the token budget (then it is dropped)."""
        key = (conv.tenant, conv.conversation_id)
        now = self.clock()
        with self._lock:
            self._expire(now)
            self._remove(key)
            if conv.num_tokens > self.max_tokens or conv.history.nbytes > self.max_bytes or self.max_conversations < 1:
                self.evicted += 1
                return False
            conv.last_used = now
            self._items[key] = conv
            self._sizes[key] = conv.history.nbytes
            self.bytes += conv.history.nbytes
            while len(self._items) > self.max_conversations or self.bytes > self.max_bytes:
                self._remove(next(iter(self._items)))
                self.evicted += 1
            return True

    def drop(self, tenant: str, conversation_id: str) -> bool:
        with self._lock:
            return self._remove((tenant, conversation_id)) is not None

    def clear(self, tenant: str | None = None) -> int:
        """Drop every conversation, or one tenant's; how many were dropped."""
        with self._lock:
            keys = [k for k in self._items if tenant is None or k[0] == tenant]
            for key in keys:
                self._remove(key)
            return len(keys)

    def __len__(self) -> int:
        return len(self._items)
