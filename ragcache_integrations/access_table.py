"""Client-side Chunk-Access Table (CRAFT): chunk ids counted over the last `window` queries.

Sorting each query's chunks by these counts (descending, ties by id) lines the hot chunks up at
the front in the same order across queries, so the engine's exact chunk-prefix reuse (CP-Tree)
hits far more often. The engine keeps one instance (`order="frequency"`, keyed per tenant); the
adapters keep their own when the order must also show to the app (LlamaIndex `source_nodes`,
LangChain `context`). Standard library only, so the adapters never import torch for it.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class ChunkAccessTable:
    def __init__(self, window: int = 1000):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._queries: deque[tuple[str, ...]] = deque()
        self._counts: Counter[str] = Counter()
        # reentrant: record_and_sort holds it across record and sort
        self._lock = threading.RLock()

    def record(self, chunk_ids: Sequence[str]) -> None:
        """One query's chunks; a chunk retrieved twice in one query counts once."""
        unique = tuple(dict.fromkeys(chunk_ids))
        with self._lock:
            self._queries.append(unique)
            self._counts.update(unique)
            # `while`, not `if`: the window may have been lowered since the last query
            while len(self._queries) > self.window:
                for cid in self._queries.popleft():
                    self._counts[cid] -= 1
                    if self._counts[cid] <= 0:
                        del self._counts[cid]

    def count(self, chunk_id: str) -> int:
        return self._counts.get(chunk_id, 0)

    def __len__(self) -> int:
        return len(self._counts)

    def sort(self, items: Sequence[T], key_of: Callable[[T], str]) -> list[T]:
        """Most-accessed first; ties broken by chunk id so equal sets always line up the same."""
        with self._lock:
            return sorted(items, key=lambda item: (-self.count(key_of(item)), key_of(item)))

    def record_and_sort(self, items: Sequence[T], key_of: Callable[[T], str]) -> list[T]:
        """Count this query's chunks, then order them, atomically: a concurrent query cannot land
        between the two and give two queries with the same chunks different orders."""
        with self._lock:
            self.record([key_of(item) for item in items])
            return self.sort(items, key_of)
