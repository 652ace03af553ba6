"""Conversation KV: a conversation's history (every prompt and answer token so far) kept so the
next turn continues from it instead of prefilling it again. Bounded by a TTL, a per-conversation
token budget and a count; whatever passes a bound is dropped whole (the next turn then starts
over with its own chunks), never half-kept."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from engine_sidecar.store.entry import ChunkKV


@dataclass
class Conversation:
    tenant: str
    conversation_id: str
    system: str
    history: ChunkKV  # prompt + answer tokens of all turns so far, exact KV at positions 0..n-1
    chunk_ids: set[str] = field(default_factory=set)
    turns: int = 1
    last_used: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return self.history.num_tokens


class ConversationStore:
    def __init__(self, ttl_s: float = 900.0, max_tokens: int = 4096, max_conversations: int = 64):
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.max_conversations = max_conversations
        self._items: OrderedDict[tuple[str, str], Conversation] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    def _expire(self, now: float) -> None:
        for key in [k for k, c in self._items.items() if now - c.last_used > self.ttl_s]:
            del self._items[key]
            self.evicted += 1

    def get(self, tenant: str, conversation_id: str) -> Conversation | None:
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            conv = self._items.get((tenant, conversation_id))
            if conv is not None:
                self._items.move_to_end((tenant, conversation_id))
            return conv

    def put(self, conv: Conversation) -> bool:
        """Keep the conversation unless it is over the token budget (then it is dropped)."""
        key = (conv.tenant, conv.conversation_id)
        with self._lock:
            self._items.pop(key, None)
            if conv.num_tokens > self.max_tokens:
                self.evicted += 1
                return False
            conv.last_used = time.monotonic()
            self._items[key] = conv
            while len(self._items) > self.max_conversations:
                self._items.popitem(last=False)
                self.evicted += 1
            return True

    def drop(self, tenant: str, conversation_id: str) -> bool:
        with self._lock:
            return self._items.pop((tenant, conversation_id), None) is not None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
