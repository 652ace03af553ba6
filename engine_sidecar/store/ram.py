"""Host-RAM tier: LRU by bytes.

Bytes are counted per tensor *storage*, not per entry: the engine keeps a CP-Tree node's KV and
the same chunk's in-context entry as two entries over the same tensors, and counting each entry's
`nbytes` charged that memory twice (the tier then evicted half of what it could hold). A storage
is counted once, whole (a view of a larger buffer keeps all of it alive), for as long as any held
entry refers to it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from engine_sidecar.store.entry import ChunkKV

_StorageKey = tuple[str, int]  # (device, data pointer)


def _storages(entry: ChunkKV) -> dict[_StorageKey, tuple[int, torch.Tensor]]:
    """The distinct storages an entry's tensors live in: key -> (bytes, a tensor pinning it)."""
    out: dict[_StorageKey, tuple[int, torch.Tensor]] = {}
    for tensor in (entry.keys, entry.values, entry.token_ids):
        storage = tensor.untyped_storage()
        out.setdefault((str(tensor.device), storage.data_ptr()), (storage.nbytes(), tensor))
    return out


class RamTier:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        # what each entry was counted as when it was put: entries are mutable (a disk entry's
        # tensors are replaced when promoted), so removal must undo exactly what put added; the
        # tensors kept here also keep a counted storage alive, so its address is never reused
        # by another storage while it is still counted
        self._held: dict[str, dict[_StorageKey, tuple[int, torch.Tensor]]] = {}
        self._refs: dict[_StorageKey, int] = {}
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

    def _pop(self, digest: str, last: bool | None = None) -> tuple[str, ChunkKV] | None:
        """With the lock held: remove one entry (`last=False`: the least recently used) and
        release the storages only it held."""
        if last is None:
            entry = self._entries.pop(digest, None)
            if entry is None:
                return None
        else:
            digest, entry = self._entries.popitem(last=last)
        for key, (size, _) in self._held.pop(digest, {}).items():
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                self._bytes -= size
        return digest, entry

    def put(self, digest: str, entry: ChunkKV) -> list[str]:
        """Insert and return the digests evicted to make room (never the new entry itself,
        unless it alone exceeds the capacity)."""
        return [gone for gone, _ in self.put_evicting(digest, entry)]

    def put_evicting(self, digest: str, entry: ChunkKV) -> list[tuple[str, ChunkKV]]:
        """`put`, returning the evicted entries themselves (for a tier behind this one)."""
        evicted: list[tuple[str, ChunkKV]] = []
        storages = _storages(entry)
        with self._lock:
            self._pop(digest)
            if sum(size for size, _ in storages.values()) > self.capacity_bytes:
                return [(digest, entry)]
            self._entries[digest] = entry
            self._held[digest] = storages
            for key, (size, _) in storages.items():
                if key not in self._refs:
                    self._refs[key] = 0
                    self._bytes += size
                self._refs[key] += 1
            # the new entry is the most recently used: alone it fits, so the loop stops before it
            while self._bytes > self.capacity_bytes:
                popped = self._pop("", last=False)
                assert popped is not None
                evicted.append(popped)
        return evicted

    def remove(self, digest: str) -> bool:
        with self._lock:
            return self._pop(digest) is not None

    def items(self) -> list[tuple[str, ChunkKV]]:
        with self._lock:
            return list(self._entries.items())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._held.clear()
            self._refs.clear()
            self._bytes = 0
