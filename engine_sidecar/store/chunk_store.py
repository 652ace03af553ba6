"""The tiered chunk KV store: RAM (LRU by bytes; on a GPU, device memory) in front of an optional
host-RAM tier (on a GPU: what device memory evicted, pinned, see store/device_copies.py), an
optional disk tier (LRU by bytes of files, see store/disk.py), and behind them an optional Redis
tier shared by several sidecars (see store/redis_tier.py)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_sidecar.errors import NON_FINITE_MESSAGE, NonFiniteKVError
from engine_sidecar.store.device_copies import DeviceCopies
from engine_sidecar.store.disk import DiskTier
from engine_sidecar.store.entry import CacheKey, ChunkKV, finite_kv_flag
from engine_sidecar.store.ram import RamTier
from engine_sidecar.store.redis_tier import RedisTier

LOADS_KEPT = 1024  # tier reads remembered for the cost estimate between two drains


@dataclass
class StoreStats:
    ram_entries: int
    ram_bytes: int
    ram_capacity_bytes: int
    disk_entries: int
    disk_bytes: int
    hits_ram: int
    hits_disk: int
    misses: int
    corrupt_files: int  # disk files that failed verification: deleted, the chunk recomputed
    disk_capacity_bytes: int = 0  # the disk tier's byte budget (0 = unlimited)
    disk_evictions: int = 0  # files removed to stay within it
    disk_write_failures: int = 0  # writes that failed (full disk, I/O error): the entry stayed in RAM only
    disk_writes_dropped: int = 0  # entries not written because the write queue was full
    # the Redis tier (all 0 without one)
    hits_redis: int = 0
    redis_misses: int = 0  # lookups Redis answered with no entry
    redis_corrupt: int = 0  # partial or damaged entries: deleted, the chunk recomputed
    redis_errors: int = 0  # failed calls (down, timeout): a miss or a dropped write
    redis_breaker_opens: int = 0  # times the circuit breaker stopped calling Redis for its cool-down
    redis_skipped: int = 0  # calls not made while the breaker was open
    redis_writes: int = 0  # entries written
    redis_writes_dropped: int = 0  # entries not written because the write queue was full
    # the host tier behind device memory (all 0 without one: on a CPU, or --host-cache-gb 0)
    host_entries: int = 0
    host_bytes: int = 0
    host_capacity_bytes: int = 0
    hits_host: int = 0
    host_demotions: int = 0  # entries device memory evicted that moved to the host tier


class ChunkStore:
    def __init__(self, ram_capacity_bytes: int, disk_dir: Path | None, device: torch.device,
                 disk_capacity_bytes: int = 0, redis: RedisTier | None = None, host_capacity_bytes: int = 0):
        self.ram = RamTier(ram_capacity_bytes)
        # inclusive: an entry read back from the host tier stays there, so evicting it from device
        # memory again costs no copy
        self.host = RamTier(host_capacity_bytes) if host_capacity_bytes > 0 else None
        self.copies = DeviceCopies(device)
        self.disk = DiskTier(disk_dir, disk_capacity_bytes) if disk_dir is not None else None
        self.redis = redis
        self.device = device
        # guards the chunk-id index, and makes "remember, then put in RAM" one step for a
        # concurrent prune (the disk writer's evictions arrive on its own thread)
        self._lock = threading.RLock()
        # chunk id -> digests of its entries, and back: only digests some tier still holds (an
        # index that kept evicted digests grew with every chunk ever seen)
        self._by_chunk_id: dict[str, set[str]] = {}
        self._ids_of: dict[str, set[str]] = {}
        if self.disk is not None:
            self.disk.on_gone = self._forget_gone
        self.hits_ram = self.hits_disk = self.hits_redis = self.hits_host = self.misses = 0
        self.host_demotions = 0
        self.refused_non_finite = 0  # entries refused by `put` for holding NaN or infinity
        # (tier, seconds, tokens) of recent disk- and Redis-tier reads, for whoever estimates load
        # costs (`drain_loads`); bounded, so a store nobody drains stays small
        self._loads: deque[tuple[str, float, int]] = deque(maxlen=LOADS_KEPT)

    def drain_loads(self) -> list[tuple[str, float, int]]:
        """(tier, seconds, tokens) of each disk- and Redis-tier read since the last call."""
        out = []
        while self._loads:
            out.append(self._loads.popleft())
        return out

    def get(self, key: CacheKey, lazy: bool = False) -> ChunkKV | None:
        """The entry from RAM, else from disk, else from Redis. With `lazy`, a disk entry comes
        back with its KV still on disk (`entry.reader`), for the executor to read a layer at a time
        while it computes; `promote` puts it in RAM once read. A Redis entry is read whole and put
        in RAM."""
        digest = key.digest
        entry = self.ram.get(digest)
        if entry is not None:
            self.hits_ram += 1
            return entry
        held = self.host.get(digest) if self.host is not None else None
        if held is not None and held.tenant == key.tenant:
            self.hits_host += 1
            entry = self.copies.to_device(held)
            self._ram_put(digest, entry)
            return entry
        if self.disk is not None and lazy:
            entry = self.disk.lazy(digest)
            if entry is not None and entry.tenant == key.tenant:
                self.hits_disk += 1
                entry.meta["_digest"] = digest
                return entry
        if self.disk is not None:
            started = time.perf_counter()
            entry = self.disk.get(digest)
            if entry is not None and entry.tenant == key.tenant:
                self.hits_disk += 1
                entry.keys, entry.values = entry.keys.to(self.device), entry.values.to(self.device)
                self._loads.append(("disk", time.perf_counter() - started, entry.num_tokens))
                self._ram_put(digest, entry)
                return entry
        if self.redis is not None:
            started = time.perf_counter()
            entry = self.redis.get(digest)
            if entry is not None and entry.tenant == key.tenant:
                self.hits_redis += 1
                entry.keys, entry.values = entry.keys.to(self.device), entry.values.to(self.device)
                self._loads.append(("redis", time.perf_counter() - started, entry.num_tokens))
                self._ram_put(digest, entry)
                return entry
        self.misses += 1
        return None

    def promote(self, entry: ChunkKV) -> None:
        """A lazily read entry, now fully in memory, joins the RAM tier."""
        digest = entry.meta.pop("_digest", None)
        entry.reader = None
        if digest is not None:
            entry.keys, entry.values = entry.keys.to(self.device), entry.values.to(self.device)
            self._ram_put(digest, entry)

    def contains(self, key: CacheKey) -> bool:
        digest = key.digest
        return (digest in self.ram or (self.host is not None and digest in self.host)
                or (self.disk is not None and digest in self.disk)
                or (self.redis is not None and self.redis.contains(digest)))

    def put(self, key: CacheKey, entry: ChunkKV, checked: bool = False) -> None:
        """Keep one entry in every tier. KV holding NaN or infinity is refused (NonFiniteKVError) and
        no tier changes: whatever computed it fails rather than poison later requests. `checked`:
        the caller ran `check_finite` on it already (one host read for several entries)."""
        if not checked and entry.reader is None:
            self.check_finite([entry])
        digest = key.digest
        if self.host is not None:  # a stale host copy must not come back in place of this one
            self.host.remove(digest)
        self._ram_put(digest, entry)
        if self.disk is None and self.redis is None:
            return
        # the writers read a host copy made on the side stream, not the device tensors (a
        # pageable `.cpu()` on their thread would stall the compute stream)
        written = self.copies.to_host(entry) if self.copies.on_gpu and entry.reader is None else entry
        if self.disk is not None:
            self.disk.put(digest, written)
        if self.redis is not None:
            self.redis.put(digest, written)

    def check_finite(self, entries: list[ChunkKV]) -> None:
        """NonFiniteKVError if any of these entries' KV holds NaN or infinity: one host read for
        all of them (each read is a sync on a GPU)."""
        loaded = [e for e in entries if e.reader is None]
        if loaded and not bool(torch.stack([finite_kv_flag(e.keys, e.values) for e in loaded]).all()):
            self.refused_non_finite += 1
            raise NonFiniteKVError(NON_FINITE_MESSAGE)

    def remove(self, key: CacheKey) -> bool:
        """Drop one entry from every tier; whether it was held."""
        return self._remove_digests({key.digest}) > 0

    def _ram_put(self, digest: str, entry: ChunkKV) -> None:
        with self._lock:
            if entry.chunk_id:
                self._by_chunk_id.setdefault(entry.chunk_id, set()).add(digest)
                self._ids_of.setdefault(digest, set()).add(entry.chunk_id)
            evicted = self.ram.put_evicting(digest, entry)
            gone = [d for d, _ in evicted]
            if self.host is not None:
                for demoted, held in evicted:
                    if held.reader is None:
                        gone += self._demote(demoted, held)
            self._forget_gone(gone)

    def _demote(self, digest: str, entry: ChunkKV) -> list[str]:
        """With the lock held: an entry device memory evicted goes to the host tier (unless it is
        there already); the digests the host tier evicted for it."""
        assert self.host is not None
        if digest in self.host:
            self.host.get(digest)  # most recently used again
            return []
        self.host_demotions += 1
        return self.host.put(digest, self.copies.to_host(entry))

    def _forget_gone(self, digests: list[str] | set[str]) -> None:
        """Drop from the chunk-id index the digests no tier holds any more (RAM evicted them, the
        disk tier evicted or lost them, or they were removed). One still queued for a disk write
        is dropped too: once written, `delete` finds it from the file's metadata."""
        if not digests:
            return
        with self._lock:
            for digest in digests:
                if digest in self.ram or (self.host is not None and digest in self.host) or (
                        self.disk is not None and digest in self.disk):
                    continue
                for chunk_id in self._ids_of.pop(digest, ()):
                    held = self._by_chunk_id.get(chunk_id)
                    if held is not None:
                        held.discard(digest)
                        if not held:
                            del self._by_chunk_id[chunk_id]

    def delete(self, chunk_id: str | None = None, tenant: str | None = None) -> int:
        """Drop all entries, or those of one chunk id, or (chunk_id None) those of one tenant;
        returns how many digests were removed. The Redis tier's entries are found by a walk over
        its keys (and all of them go with a full clear, other sidecars' too: they share it)."""
        self.flush()
        if chunk_id is None and tenant is not None:
            digests = {d for d, entry in self.ram.items() if entry.tenant == tenant}
            if self.host is not None:
                digests |= {d for d, entry in self.host.items() if entry.tenant == tenant}
            if self.disk is not None:
                digests |= self.disk.digests_of_tenant(tenant)
            if self.redis is not None:
                digests |= self.redis.digests_of(None, tenant)
            return self._remove_digests(digests)
        if chunk_id is None:
            # a union of digests, not a sum of tier sizes: an entry in RAM, on disk and in Redis
            # is one chunk deleted
            digests = {d for d, _ in self.ram.items()}
            self.ram.clear()
            if self.host is not None:
                digests.update(d for d, _ in self.host.items())
                self.host.clear()
            if self.disk is not None:
                digests.update(self.disk.digests())
                self.disk.clear()
            if self.redis is not None:
                digests |= self.redis.clear()
            with self._lock:
                self._by_chunk_id.clear()
                self._ids_of.clear()
            return len(digests)
        with self._lock:
            digests = set(self._by_chunk_id.get(chunk_id, set()))
        if self.disk is not None:  # entries from before a restart are only known on disk
            digests |= self.disk.digests_of(chunk_id)
        if tenant is not None:  # the same id under another tenant is another tenant's entry
            digests = {d for d in digests if self._tenant_of(d) == tenant}
        if self.redis is not None:
            digests |= self.redis.digests_of(chunk_id, tenant)
        return self._remove_digests(digests)

    def _tenant_of(self, digest: str) -> str | None:
        entry = self.ram.get(digest) or (self.host.get(digest) if self.host is not None else None)
        if entry is not None:
            return entry.tenant
        if self.disk is not None and digest in self.disk.digests():
            return self.disk.metadata(digest).get("tenant", "")
        return None

    def _remove_digests(self, digests: set[str]) -> int:
        removed = 0
        in_redis = self.redis.remove_many(digests) if self.redis is not None else set()
        for digest in digests:
            hit = self.ram.remove(digest)
            if self.host is not None:
                hit = self.host.remove(digest) or hit
            if self.disk is not None:
                hit = self.disk.remove(digest) or hit
            removed += int(hit or digest in in_redis)
        self._forget_gone(digests)
        return removed

    def chunk_id_index(self) -> dict[str, set[str]]:
        """A copy of the chunk-id index (chunk id -> digests held in some tier), for checks."""
        with self._lock:
            return {chunk_id: set(held) for chunk_id, held in self._by_chunk_id.items()}

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()
        if self.redis is not None:
            self.redis.flush()

    def close(self) -> None:
        """Finish the queued writes and end the tiers' writer threads (a later put starts them
        again); the disk tier lets go of its folder."""
        if self.disk is not None:
            self.disk.close()
        if self.redis is not None:
            self.redis.close()

    def stats(self) -> StoreStats:
        """Counters only (the disk tier's in-memory index): never a folder walk nor a Redis call."""
        disk = self.disk
        counters = disk.counters if disk is not None else None
        shared = self.redis.counters if self.redis is not None else None
        return StoreStats(
            ram_entries=len(self.ram),
            ram_bytes=self.ram.bytes_used,
            ram_capacity_bytes=self.ram.capacity_bytes,
            disk_entries=len(disk) if disk is not None else 0,
            disk_bytes=disk.bytes_used if disk is not None else 0,
            hits_ram=self.hits_ram,
            hits_disk=self.hits_disk,
            misses=self.misses,
            corrupt_files=counters.corrupt_files if counters else 0,
            disk_capacity_bytes=disk.capacity_bytes if disk is not None else 0,
            disk_evictions=counters.evictions if counters else 0,
            disk_write_failures=counters.write_failures if counters else 0,
            disk_writes_dropped=counters.writes_dropped if counters else 0,
            hits_redis=self.hits_redis,
            redis_misses=shared.misses if shared else 0,
            redis_corrupt=shared.corrupt if shared else 0,
            redis_errors=shared.errors if shared else 0,
            redis_breaker_opens=self.redis.breaker.opened if self.redis is not None else 0,
            redis_skipped=shared.skipped if shared else 0,
            redis_writes=shared.writes if shared else 0,
            redis_writes_dropped=shared.writes_dropped if shared else 0,
            host_entries=len(self.host) if self.host is not None else 0,
            host_bytes=self.host.bytes_used if self.host is not None else 0,
            host_capacity_bytes=self.host.capacity_bytes if self.host is not None else 0,
            hits_host=self.hits_host,
            host_demotions=self.host_demotions,
        )
