"""Host-RAM tier: LRU by bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from engine_sidecar.store.entry import ChunkKV


class RamTier:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> ChunkKV | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries.move_to_end(digest)
            return entry

    def put(self, digest: str, entry: ChunkKV) -> list[str]:
        """Insert and return the digests evicted to make room (never the new entry itself,
        unless it alone exceeds the capacity)."""
        evicted: list[str] = []
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= old.nbytes
            if entry.nbytes > self.capacity_bytes:
                return [digest]
            self._entries[digest] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.capacity_bytes:
                victim, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
                evicted.append(victim)
        return evicted

    def remove(self, digest: str) -> bool:
        with self._lock:
            entry = self._entries.pop(digest, None)
            if entry is None:
                return False
            self._bytes -= entry.nbytes
            return True

    def items(self) -> list[tuple[str, ChunkKV]]:
        with self._lock:
            return list(self._entries.items())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
