"""Disk tier: one safetensors file per chunk, written atomically, checksum verified on read.

A damaged or truncated file is reported once as a warning, deleted, counted, and treated as a
miss: the chunk is simply recomputed. Writes go through a background thread so a request never
waits on the disk; `flush()` waits for pending writes (on shutdown), never longer than a bound.

Bounds: the tier holds at most `capacity_bytes` of files (0 = unlimited), least recently used out
first. What it holds is an in-memory index (size, last access, header metadata once read), built
once at start-up from the folder (file sizes and mtimes; a hit also touches the file's mtime, so
the order survives a restart), so lookups, stats and deletes never walk the folder.

Faults: a file is written to a temp file, fsynced, renamed into place, and the folder fsynced; a
write that fails (a full disk, any error) leaves no file behind, is logged and counted, and the
entry simply stays in RAM only. Temp files left by a crash are removed at start-up.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from engine_sidecar.store.entry import ChunkKV, finite_kv
from engine_sidecar.store.folder_claim import OWNER_FILE as OWNER_FILE
from engine_sidecar.store.folder_claim import claim, other_process_alive
from engine_sidecar.store.folder_claim import folder_owner as folder_owner
from engine_sidecar.store.write_queue import WriteQueue

log = logging.getLogger("ragcache.store")
_SUFFIX = ".kv.safetensors"
_RESERVED_META = ("digest", "checksum", "aux_checksum", "chunk_id", "tenant")
_TMP = ".tmp"


class DamagedCacheFile(RuntimeError):
    """A stored chunk's file failed verification while it was being read layer by layer."""


class LayerReader:
    """Reads one stored chunk's KV a layer at a time (safetensors slices), or only some token
    rows of a layer, verifying every row read against the row checksums written with it: what
    layer-wise prefetch reads while earlier layers are computed."""

    def __init__(self, tier: DiskTier, digest: str, path: Path, handle, row_sums: torch.Tensor):
        self.tier, self.digest, self.path = tier, digest, path
        self._handle, self._row_sums = handle, row_sums
        self._memory: ChunkKV | None = None  # set by `read_into`: reads come from it
        self.rows_read = 0  # token rows read by `rows` (sparse load), over all layers

    @property
    def num_layers(self) -> int:
        return int(self._row_sums.shape[0])

    def _verify(self, index: int, start: int, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        why = None
        if not torch.equal(_row_sums(keys, values)[0], self._row_sums[index, start:end]):
            why = "checksum mismatch"
        elif not finite_kv(keys, values):  # intact, but reading it would poison the request
            why = "NaN or infinity"
        if why is not None:
            self.tier.forget_damaged(self.path, f"layer {index} rows {start}-{end}: {why}")
            raise DamagedCacheFile(f"chunk cache file {self.path.name}: layer {index} is damaged")

    def read_into(self, entry: ChunkKV) -> None:
        """Every layer, verified, into the entry. The entry stays lazy for whoever reads it next
        (the executor's prefetcher copies it into the request's buffer a layer at a time): from now
        on `layer` and `rows` serve it from memory instead of reading the file again."""
        for layer in range(self.num_layers):
            keys, values = self.layer(layer)
            entry.keys[layer].copy_(keys)
            entry.values[layer].copy_(values)
        self._memory = entry

    def rows(self, index: int, rows: torch.Tensor, max_gap: int = 8) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Only these token rows of one layer (ascending local indices), read as contiguous runs
        (through gaps up to max_gap rows) and verified row by row: (start, end, keys, values)."""
        if self._memory is not None:
            return [(start, end, self._memory.keys[index, start:end], self._memory.values[index, start:end])
                    for start, end in row_runs(rows, max_gap)]
        out = []
        keys_slice, values_slice = self._handle.get_slice("keys"), self._handle.get_slice("values")
        for start, end in row_runs(rows, max_gap):
            keys = keys_slice[index : index + 1, start:end]
            values = values_slice[index : index + 1, start:end]
            self._verify(index, start, end, keys, values)
            out.append((start, end, keys[0], values[0]))
            self.rows_read += end - start
        return out

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._memory is not None:
            return self._memory.keys[index], self._memory.values[index]
        keys = self._handle.get_slice("keys")[index : index + 1]
        values = self._handle.get_slice("values")[index : index + 1]
        self._verify(index, 0, keys.shape[1], keys, values)
        return keys[0], values[0]

    def close(self) -> None:
        self._handle = None


def _row_sums(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[L, n] int64: a position-weighted sum of each (layer, token) row's 32-bit words, K then V.
    Any changed word changes it; computed with tensor ops, so verifying the rows of a sparse
    read costs little next to reading them."""
    words = torch.cat([keys.contiguous().view(torch.int32).flatten(2), values.contiguous().view(torch.int32).flatten(2)],
                      dim=2).to(torch.int64)
    weights = torch.arange(1, words.shape[2] + 1, dtype=torch.int64)
    return (words * weights).sum(dim=2)


def row_runs(rows: torch.Tensor, max_gap: int) -> list[tuple[int, int]]:
    """Ascending row indices -> [start, end) ranges, reading through gaps up to max_gap rows."""
    out: list[tuple[int, int]] = []
    for r in rows.tolist():
        if out and r - out[-1][1] <= max_gap:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def _checksum(entry_tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(entry_tensors):
        t = entry_tensors[name].contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class _Indexed:
    """One file the tier holds: its size, and its header metadata once read."""

    size: int
    meta: dict[str, str] | None = None


@dataclass
class DiskCounters:
    corrupt_files: int = 0  # files that failed verification: deleted, the chunk recomputed
    write_failures: int = 0  # writes that failed (full disk, I/O error, any exception): entry kept in RAM only
    writes_dropped: int = 0  # entries not written because the write queue was over its byte bound
    evictions: int = 0  # files removed to stay within the byte budget
    orphans_removed: int = 0  # temp files of crashed writers removed at start-up
    errors: list[str] = field(default_factory=list)  # the last few failure messages (newest last)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in this folder durable; a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    """Write and fsync one file (the temp file of an atomic replace)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _aux_checksum(token_ids: torch.Tensor, scores: torch.Tensor | None, meta: dict[str, str]) -> str:
    """What the KV row checksums leave out, for a lazy read to verify up front: token ids, scores
    and the header metadata (chunk id, tenant, Cache-Craft variant)."""
    tensors = {"token_ids": token_ids} if scores is None else {"token_ids": token_ids, "tune_scores": scores}
    h = hashlib.blake2b(_checksum(tensors).encode(), digest_size=16)
    h.update(_meta_bytes(meta, ("checksum", "aux_checksum")))
    return h.hexdigest()


def _meta_bytes(meta: dict[str, str], leave_out: tuple[str, ...]) -> bytes:
    return b"".join(f"{len(k)}:{k}={len(meta[k])}:{meta[k]};".encode() for k in sorted(meta) if k not in leave_out)


def _file_checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """Every tensor and every metadata entry but the checksum itself ('2:' marks this format;
    files from before it hold `_checksum(tensors)` alone, which a flipped byte cannot turn into)."""
    h = hashlib.blake2b(_checksum(tensors).encode(), digest_size=16)
    h.update(_meta_bytes(meta, ("checksum",)))
    return "2:" + h.hexdigest()


def _verify_file(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    stored = meta.get("checksum", "")
    expected = _file_checksum(tensors, meta) if stored.startswith("2:") else _checksum(tensors)
    if stored != expected:
        raise ValueError("checksum mismatch")
    if not finite_kv(tensors["keys"], tensors["values"]):
        raise ValueError("NaN or infinity in the KV")


class DiskTier:
    """Files under `directory/<2 hex>/<digest>.kv.safetensors`, one per chunk."""

    def __init__(self, directory: Path, capacity_bytes: int = 0, flush_timeout_s: float = 120.0,
                 max_pending_bytes: int = 1 << 30):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = max(0, int(capacity_bytes))
        self.flush_timeout_s = flush_timeout_s
        self.counters = DiskCounters()
        self._lock = threading.Lock()  # guards the index and the counters
        self._index: OrderedDict[str, _Indexed] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._scan()
        # held while the tier is open (`close`, or its collection), so `cache clear` refuses meanwhile
        self._release_folder = weakref.finalize(self, claim(self.directory))
        # a write removed while under way has its file deleted once written (`on_cancelled`)
        self._writes: WriteQueue[ChunkKV] = WriteQueue("ragcache-disk-writer", self._write_queued,
                                                       max_pending_bytes, on_cancelled=self._delete_file)
        # told (outside the tier's lock) which digests the tier itself let go of: evicted, found
        # damaged or missing; the chunk store prunes its chunk-id index with it
        self.on_gone: Callable[[list[str]], None] | None = None

    # --- start-up ------------------------------------------------------------------------------
    def _scan(self) -> None:
        """The index from the folder, once: file sizes and mtimes; temp files whose writer is
        gone removed; over the budget (lowered since), the oldest files removed."""
        found: list[tuple[float, str, int]] = []
        for sub in self.directory.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for path in sub.iterdir():
                name = path.name
                try:
                    if name.endswith(_TMP):
                        if not other_process_alive(_tmp_pid(name)):  # its writer may still be at work
                            path.unlink(missing_ok=True)
                            self.counters.orphans_removed += 1
                        continue
                    if name.endswith(_SUFFIX):
                        st = path.stat()
                        found.append((st.st_mtime, name[: -len(_SUFFIX)], st.st_size))
                except OSError:
                    continue
        for _, digest, size in sorted(found):
            self._index[digest] = _Indexed(size)
            self._bytes += size
        if self.counters.orphans_removed:
            log.warning("removed %d temp file(s) left by an interrupted write in %s", self.counters.orphans_removed,
                        self.directory)
        with self._lock:
            self._evict_to(0)

    # --- index -----------------------------------------------------------------------------------
    def path_for(self, digest: str) -> Path:
        return self.directory / digest[:2] / f"{digest}{_SUFFIX}"

    def __contains__(self, digest: str) -> bool:
        return digest in self._index

    def __len__(self) -> int:
        return len(self._index)

    def _touch(self, digest: str) -> None:
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
        try:  # the order of last use survives a restart
            os.utime(self.path_for(digest))
        except OSError:
            pass

    def _drop(self, digest: str) -> _Indexed | None:
        with self._lock:
            item = self._index.pop(digest, None)
            if item is not None:
                self._bytes -= item.size
            return item

    def _evict_to(self, incoming: int) -> list[str]:
        """With the lock held: remove least recently used files until `incoming` more bytes fit;
        the digests removed."""
        evicted: list[str] = []
        if not self.capacity_bytes:
            return evicted
        while self._index and self._bytes + incoming > self.capacity_bytes:
            digest, item = self._index.popitem(last=False)
            self._bytes -= item.size
            self.counters.evictions += 1
            evicted.append(digest)
            try:
                self.path_for(digest).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove evicted chunk cache file %s: %s", digest, exc)
        return evicted

    def _gone(self, digests: list[str]) -> None:
        if digests and self.on_gone is not None:
            try:
                self.on_gone(digests)
            except Exception:  # noqa: BLE001 - bookkeeping elsewhere must never break the tier
                log.exception("on_gone callback failed")

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def digests(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def metadata(self, digest: str) -> dict[str, str]:
        """The file's header metadata: read once, then kept in the index."""
        item = self._index.get(digest)
        if item is None:
            return {}
        if item.meta is not None:
            return item.meta
        from safetensors import safe_open

        try:
            with safe_open(str(self.path_for(digest)), framework="pt") as handle:
                meta = handle.metadata() or {}
        except Exception:
            return {}
        item.meta = meta
        return meta

    def digests_of(self, chunk_id: str) -> set[str]:
        return {d for d in self.digests() if self.metadata(d).get("chunk_id") == chunk_id}

    def digests_of_tenant(self, tenant: str) -> set[str]:
        return {d for d in self.digests() if self.metadata(d).get("tenant", "") == tenant}

    def _note_failure(self, counter: str, message: str) -> None:
        with self._lock:
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)
            self.counters.errors = [*self.counters.errors[-9:], message]

    @property
    def corrupt_files_seen(self) -> int:
        return self.counters.corrupt_files

    # --- writes ----------------------------------------------------------------------------------
    def put(self, digest: str, entry: ChunkKV) -> None:
        """Queue one entry for writing; dropped (and counted) when the queue already holds
        `max_pending_bytes` (a disk slower than the requests must not grow memory without bound)."""
        if not self._writes.put(digest, entry, entry.nbytes):
            self._note_failure("writes_dropped", f"{digest}: write queue full")

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the writes queued so far; False if they did not finish within the bound (or
        the writer is gone): never blocks forever."""
        return self._writes.flush(self.flush_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> bool:
        """Finish the writes queued so far (within the flush bound), end the writer thread and let
        go of the folder; False if a write did not finish (then the folder stays held until this
        process ends, as the write may still land). A later `put` starts the writer again."""
        if not self._writes.close(self.flush_timeout_s):
            return False
        self._release_folder()
        return True

    def _write_queued(self, digest: str, entry: ChunkKV) -> None:
        """The writer thread's step: `_write` is looked up per call (tests replace it on the
        instance), and any failure drops this entry, never the writer."""
        try:
            self._write(digest, entry)
        except Exception as exc:  # noqa: BLE001 - a full disk, an I/O error, a bad entry: all the same here
            log.warning("could not write chunk cache file %s (kept in RAM only): %r", digest, exc)
            self._note_failure("write_failures", f"{digest}: {exc!r}")

    def _write(self, digest: str, entry: ChunkKV) -> None:
        path = self.path_for(digest)
        entry.wait_ready()
        keys, values = entry.keys.cpu().contiguous(), entry.values.cpu().contiguous()
        if not finite_kv(keys, values):
            raise ValueError("NaN or infinity in the KV: not written")
        token_ids = entry.token_ids.cpu().contiguous()
        scores = entry.tune_scores().contiguous()
        tensors = {"keys": keys, "values": values, "token_ids": token_ids, "tune_scores": scores,
                   "row_sums": _row_sums(keys, values)}
        meta = {"digest": digest, "chunk_id": entry.chunk_id or "", "tenant": entry.tenant,
                **{k: str(v) for k, v in entry.meta.items()}}
        meta["aux_checksum"] = _aux_checksum(token_ids, scores, meta)
        meta["checksum"] = _file_checksum(tensors, meta)
        data = save(tensors, metadata=meta)
        size = len(data)
        if self.capacity_bytes and size > self.capacity_bytes:
            log.info("chunk cache file %s (%d bytes) exceeds the disk budget; not written", digest, size)
            return
        self._drop(digest)  # rewritten (same digest): its old bytes are freed first
        with self._lock:
            evicted = self._evict_to(size)
        self._gone(evicted)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}{_TMP}")
        try:
            _write_file(tmp, data)
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise
        _fsync_dir(path.parent)
        with self._lock:
            self._index[digest] = _Indexed(size, meta)
            self._bytes += size

    # --- reads -----------------------------------------------------------------------------------
    def get(self, digest: str) -> ChunkKV | None:
        if digest not in self._index:
            return None
        path = self.path_for(digest)
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
            tensors = load_file(str(path))
            if meta.get("digest") != digest:
                raise ValueError("digest mismatch")
            _verify_file(meta, tensors)
        except FileNotFoundError:  # removed meanwhile (evicted, deleted by hand): a plain miss
            self._drop(digest)
            self._gone([digest])
            return None
        except Exception as exc:  # any damage at all must end as a miss, never a crash
            self.forget_damaged(path, str(exc))
            return None
        self._touch(digest)
        extra = {k: v for k, v in meta.items() if k not in _RESERVED_META}
        return ChunkKV(tensors["keys"], tensors["values"], tensors["token_ids"],
                       meta.get("chunk_id") or None, meta.get("tenant", ""), extra, scores=tensors.get("tune_scores"))

    def forget_damaged(self, path: Path, why: str) -> None:
        self._note_failure("corrupt_files", f"{path.name}: {why}")
        log.warning("chunk cache file %s is damaged (%s); recomputing it", path.name, why)
        digest = path.name[: -len(_SUFFIX)] if path.name.endswith(_SUFFIX) else path.name
        self._drop(digest)
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
        self._gone([digest])

    def lazy(self, digest: str) -> ChunkKV | None:
        """The entry with its token ids and shapes read now (verified) and its KV still on disk, to
        be read a layer at a time (`ChunkKV.reader`); None if absent, damaged, or written before
        row and metadata checksums existed (then `get` reads it whole)."""
        if digest not in self._index:
            return None
        path = self.path_for(digest)
        try:
            from safetensors import safe_open

            handle = safe_open(str(path), framework="pt")
            meta = handle.metadata() or {}
            names = set(handle.keys())
            if meta.get("digest") != digest or "row_sums" not in names or "aux_checksum" not in meta:
                return None  # `get` reads it whole and verifies all of it
            token_ids = handle.get_tensor("token_ids")
            row_sums = handle.get_tensor("row_sums")
            scores = handle.get_tensor("tune_scores") if "tune_scores" in names else None
            if meta["aux_checksum"] != _aux_checksum(token_ids, scores, meta):
                raise ValueError("token ids, scores or metadata checksum mismatch")
            shape = handle.get_slice("keys").get_shape()
            dtype = handle.get_slice("keys").get_dtype()
            if len(shape) != 4 or tuple(row_sums.shape) != tuple(shape[:2]) or shape[1] != token_ids.shape[0]:
                raise ValueError("shapes disagree with the row checksums")
        except FileNotFoundError:
            self._drop(digest)
            self._gone([digest])
            return None
        except Exception as exc:  # a damaged header is a miss, like in `get`
            self.forget_damaged(path, str(exc))
            return None
        torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(dtype)
        if torch_dtype is None:
            return None
        self._touch(digest)
        keys = torch.empty(shape, dtype=torch_dtype)
        values = torch.empty(shape, dtype=torch_dtype)
        extra = {k: v for k, v in meta.items() if k not in _RESERVED_META}
        entry = ChunkKV(keys, values, token_ids, meta.get("chunk_id") or None, meta.get("tenant", ""), extra,
                        scores=scores)
        entry.reader = LayerReader(self, digest, path, handle, row_sums)
        return entry

    # --- deletes ---------------------------------------------------------------------------------
    def remove(self, digest: str) -> bool:
        """Remove the file and any write of it still queued or under way (a queued write would
        otherwise put a removed entry back on disk after the remove)."""
        discarded = self._writes.discard((digest,))
        return self._delete_file(digest) or discarded > 0

    def _delete_file(self, digest: str) -> bool:
        existed = self._drop(digest) is not None
        try:
            self.path_for(digest).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove chunk cache file %s: %s", digest, exc)
        return existed

    def clear(self) -> None:
        self.flush()
        for digest in self.digests():
            self.remove(digest)


def _tmp_pid(name: str) -> int:
    """The writer's pid in a temp file's name (`.<file>.<pid>.<thread>.tmp`); 0 if none."""
    parts = name.split(".")
    try:
        return int(parts[-3])
    except (IndexError, ValueError):
        return 0
