"""Request KV buffers recycled on a CPU.

A request's KV buffer (keys before and after RoPE and values, every layer, prompt + max_tokens
rows) is large: SmolLM2 in bf16 needs 115 MB for a 5K-token prompt. Freshly allocated, every page
of it is faulted in and zeroed by the kernel the first time the prefill writes it, on the
request's path before its first token (docs/architecture.md, "Execute", has the measurement). A
finished sequence's buffer is kept here and the next request's buffer is a view of it, whose
pages are already mapped.

Only the scheduler's sequences take buffers from the pool, and only `Sequence.release` gives one
back, when the sequence leaves the running set: nothing else holds a view of the buffer by then
(what the engine keeps from a buffer, chunk KV and conversation history, is cloned out of it).
On a GPU torch's caching allocator already recycles device memory, so the engine builds no pool.
"""

from __future__ import annotations

import threading

import torch

from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.model.runner import ModelRunner

HEADROOM = 1.5  # a new storage's size over the request's need


class KVPool:
    def __init__(self, runner: ModelRunner, max_bytes: int, max_buffers: int):
        """Keeps at most `max_buffers` buffers of `max_bytes` in all (their reserved size), the
        largest first."""
        self.runner = runner
        self.max_bytes, self.max_buffers = max_bytes, max(0, max_buffers)
        c = runner.config
        self._row = c.num_layers * c.num_kv_heads * c.head_dim  # elements per token row, per tensor
        self._bytes_per_element = torch.empty((), dtype=runner.dtype).element_size()
        self._free: list[tuple[torch.Tensor, ...]] = []  # flat (keys_pre, keys, values) storages
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out from the pool (for stats and tests)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._bytes(storage) for storage in self._free)

    def take(self, capacity: int) -> KVBuffer:
        """A buffer of `capacity` rows: a view of the smallest kept storage that fits, else new."""
        need = capacity * self._row
        with self._lock:
            fits = [i for i, storage in enumerate(self._free) if storage[0].numel() >= need]
            storage = self._free.pop(min(fits, key=lambda i: self._free[i][0].numel())) if fits else None
        if storage is None:
            kw = {"dtype": self.runner.dtype, "device": self.runner.device}
            # room for a later, longer request: pages never written are never mapped, so the
            # headroom costs address space, not memory
            storage = tuple(torch.empty(int(need * HEADROOM), **kw) for _ in range(3))
        else:
            self.reused += 1
        c = self.runner.config
        shape = (c.num_layers, capacity, c.num_kv_heads, c.head_dim)
        keys_pre, keys, values = (flat[:need].view(shape) for flat in storage)
        return KVBuffer(keys_pre, keys, values, storage=storage)

    def give(self, kv: KVBuffer) -> None:
        """Keep `kv`'s storage for a later request; its views must no longer be read or written."""
        storage = kv.storage
        kv.storage = None
        if storage is None or storage[0].device != self.runner.device:
            return  # grown past its storage by decode (a new allocation), or not from a pool
        with self._lock:
            kept = sorted([*self._free, storage], key=self._bytes, reverse=True)
            self._free, total = [], 0
            for candidate in kept:
                if len(self._free) < self.max_buffers and total + self._bytes(candidate) <= self.max_bytes:
                    self._free.append(candidate)
                    total += self._bytes(candidate)

    def _bytes(self, storage: tuple[torch.Tensor, ...]) -> int:
        return 3 * storage[0].numel() * self._bytes_per_element
