"""CA-Table (CRAFT): chunk access counts over a sliding window of the last W requests.

Sorting retrieved chunks by these counts (descending, ties by id) lines hot chunks up at the
front in the same order across requests, so exact chunk-prefix reuse hits far more often; chunk
order barely changes answers. Updates are O(k) per request and memory is bounded by W·k.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence
from typing import Literal, TypeVar

from engine_sidecar.errors import InvalidPromptError

Order = Literal["preserve", "frequency", "hits-first"]
T = TypeVar("T")


class ChunkAccessTable:
    def __init__(self, window: int = 1000):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._requests: deque[tuple[str, ...]] = deque()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def record(self, chunk_ids: Sequence[str]) -> None:
        unique = tuple(dict.fromkeys(chunk_ids))
        with self._lock:
            self._requests.append(unique)
            self._counts.update(unique)
            if len(self._requests) > self.window:
                for cid in self._requests.popleft():
                    self._counts[cid] -= 1
                    if self._counts[cid] <= 0:
                        del self._counts[cid]

    def count(self, chunk_id: str) -> int:
        return self._counts.get(chunk_id, 0)

    def __len__(self) -> int:
        return len(self._counts)

    def sort(self, items: Sequence[T], key_of) -> list[T]:
        """Most-accessed first; ties broken by chunk id so equal sets always line up the same."""
        return sorted(items, key=lambda item: (-self.count(key_of(item)), key_of(item)))


def access_key(tenant: str, chunk_id: str) -> str:
    """The CA-Table key: chunk ids count per tenant."""
    return f"{tenant}\x00{chunk_id}"


def check_order(order: str) -> Order:
    if order not in ("preserve", "frequency", "hits-first"):
        raise InvalidPromptError(f"unknown order '{order}': use preserve, frequency or hits-first")
    return order  # type: ignore[return-value]
