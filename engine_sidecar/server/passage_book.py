"""Passages this sidecar has been sent, per tenant: what lets a plain OpenAI chat gain reuse.

An OpenAI app that already puts its retrieved passages in the messages, and never sends the
`chunks` extension, still repeats those passages request after request. The sidecar remembers the
passages it saw (warmed with /v1/chunks/warm, or sent as chunks on any route) and looks for them
in a plain chat's messages, as the framework adapters do on the client side: a passage found
verbatim becomes a chunk of the verbatim layout, so the model computes exactly the tokens of the
plain chat and only the passages' KV is reused. Matching is exact substring search over at most
`capacity` passages per tenant (the newest kept), and tenants never see each other's passages.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ragcache_integrations.recovery import ChunkRegistry, Recovery, to_chunked_prompt
from ragcache_integrations.types import Chunk

MAX_TENANTS = 256  # the least recently used tenant's passages are forgotten past this


class PassageBook:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_tenant: OrderedDict[str, ChunkRegistry] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, chunks: list[Chunk], tenant: str) -> None:
        if self.capacity <= 0 or not chunks:
            return
        with self._lock:
            book = self._by_tenant.pop(tenant, None) or ChunkRegistry(self.capacity)
            self._by_tenant[tenant] = book
            while len(self._by_tenant) > MAX_TENANTS:
                self._by_tenant.popitem(last=False)
        for chunk in chunks:
            book.add(chunk.text, chunk.id)

    def find(self, messages: list[dict[str, str]], tenant: str, conversation_id: str | None) -> Recovery:
        """The messages as a verbatim-layout prompt with the remembered passages they quote, or
        why they stay a plain chat."""
        with self._lock:
            book = self._by_tenant.get(tenant)
        if book is None:
            return Recovery(None, "no passages remembered for this tenant")
        return to_chunked_prompt(messages, book.snapshot(), conversation_id=conversation_id)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(book) for book in self._by_tenant.values())
