"""Passages this sidecar has been sent, per tenant: what lets a plain OpenAI chat gain reuse.

An OpenAI app that already puts its retrieved passages in the messages, and never sends the
`chunks` extension, still repeats those passages request after request. The sidecar remembers the
passages it saw (warmed with /v1/chunks/warm, or sent as chunks on any route, once the engine
accepted the request) and looks for them in a plain chat's messages, as the framework adapters
do on the client side: a passage found verbatim becomes a chunk of the verbatim layout, so the
model computes exactly the tokens of the plain chat and only the passages' KV is reused.

Bounds: at most `capacity` passages per tenant (its oldest forgotten first) and `budget_bytes`
for all tenants together. Past the budget the tenant holding the most bytes gives up its oldest
passages first, so a tenant within its fair share (the budget over the tenants holding
passages) keeps them however many other tenants fill the memory. Past `MAX_TENANTS` tenants the
least recently used one (a remembered passage or a match refreshes it) is forgotten. Tenants
never see each other's passages; `forget` drops one tenant's or all.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TypeVar

from ragcache_integrations.recovery import Candidate, Recovery, to_chunked_prompt
from ragcache_integrations.types import Chunk

MAX_TENANTS = 4096  # the least recently used tenant's passages are forgotten past this
Item = TypeVar("Item")


class _TenantBook:
    def __init__(self) -> None:
        self.passages: OrderedDict[str, Candidate] = OrderedDict()  # stripped text -> passage, newest last
        self.bytes = 0


def _size(text: str) -> int:
    return sys.getsizeof(text)


class PassageBook:
    def __init__(self, capacity: int, budget_bytes: int = 256 << 20):
        self.capacity, self.budget_bytes = capacity, budget_bytes
        self._tenants: OrderedDict[str, _TenantBook] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        return self._bytes

    def remember(self, chunks: list[Chunk], tenant: str) -> None:
        if self.capacity <= 0 or self.budget_bytes <= 0 or not chunks:
            return
        with self._lock:
            book = self._tenants.pop(tenant, None) or _TenantBook()
            self._tenants[tenant] = book
            for chunk in chunks:
                self._add(book, chunk)
            while len(book.passages) > self.capacity:
                self._drop_oldest(book)
            while len(self._tenants) > MAX_TENANTS:
                self._forget_locked(next(iter(self._tenants)))
            self._fit_budget()

    def _add(self, book: _TenantBook, chunk: Chunk) -> None:
        key = chunk.text.strip()
        if not key:
            return
        previous = book.passages.pop(key, None)
        if previous is not None:
            book.bytes -= _size(previous.text)
            self._bytes -= _size(previous.text)
        book.passages[key] = Candidate(key, chunk.id or (previous.id if previous is not None else None))
        book.bytes += _size(key)
        self._bytes += _size(key)

    def _drop_oldest(self, book: _TenantBook) -> None:
        _, gone = book.passages.popitem(last=False)
        book.bytes -= _size(gone.text)
        self._bytes -= _size(gone.text)

    def _fit_budget(self) -> None:
        """The largest holder gives up its oldest passages until all fit the budget."""
        while self._bytes > self.budget_bytes:
            tenant, book = max(self._tenants.items(), key=lambda item: item[1].bytes)
            self._drop_oldest(book)
            if not book.passages:
                self._forget_locked(tenant)

    def _forget_locked(self, tenant: str) -> None:
        book = self._tenants.pop(tenant, None)
        if book is not None:
            self._bytes -= book.bytes

    def forget(self, tenant: str | None) -> None:
        """One tenant's passages, or every tenant's (None): with the tenant's cache."""
        with self._lock:
            if tenant is None:
                self._tenants.clear()
                self._bytes = 0
            else:
                self._forget_locked(tenant)

    def find(self, messages: list[dict[str, str]], tenant: str, conversation_id: str | None) -> Recovery:
        """The messages as a verbatim-layout prompt with the remembered passages they quote, or
        why they stay a plain chat. A match counts as use of the tenant's passages."""
        with self._lock:
            book = self._tenants.get(tenant)
            snapshot = list(reversed(book.passages.values())) if book is not None else []
        if not snapshot:
            return Recovery(None, "no passages remembered for this tenant")
        found = to_chunked_prompt(messages, snapshot, conversation_id=conversation_id)
        if found.prompt is not None:
            with self._lock:
                if tenant in self._tenants:
                    self._tenants.move_to_end(tenant)
        return found

    def remembering(self, events: Iterator[Item], chunks: list[Chunk], tenant: str) -> Iterator[Item]:
        """`events` passed through; the chunks remembered once the first event shows the engine
        accepted the request (a refused one, 400, 413 or 429, adds nothing)."""
        first = True
        for event in events:
            if first:
                self.remember(chunks, tenant)
                first = False
            yield event

    def __len__(self) -> int:
        with self._lock:
            return sum(len(book.passages) for book in self._tenants.values())
