"""Disk tier: one safetensors file per chunk, written atomically, checksum verified on read.

A damaged or truncated file is reported once as a warning, deleted, and treated as a miss: the
chunk is simply recomputed. Writes go through a background thread so a request never waits on
the disk; `flush()` waits for pending writes (on shutdown).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine_sidecar.frequency import frequency_scores
from engine_sidecar.store.entry import ChunkKV

log = logging.getLogger("ragcache.store")
_SUFFIX = ".kv.safetensors"
_RESERVED_META = ("digest", "checksum", "chunk_id", "tenant")


class DamagedCacheFile(RuntimeError):
    """A stored chunk's file failed verification while it was being read layer by layer."""


class LayerReader:
    """Reads one stored chunk's KV a layer at a time (safetensors slices), or only some token
    rows of a layer, verifying every row read against the row checksums written with it: what
    layer-wise prefetch reads while earlier layers are computed."""

    def __init__(self, tier: DiskTier, digest: str, path: Path, handle, row_sums: torch.Tensor):
        self.tier, self.digest, self.path = tier, digest, path
        self._handle, self._row_sums = handle, row_sums
        self.rows_read = 0  # token rows read by `rows` (sparse load), over all layers

    @property
    def num_layers(self) -> int:
        return int(self._row_sums.shape[0])

    def _verify(self, index: int, start: int, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not torch.equal(_row_sums(keys, values)[0], self._row_sums[index, start:end]):
            self.tier.forget_damaged(self.path, f"layer {index} rows {start}-{end} checksum mismatch")
            raise DamagedCacheFile(f"chunk cache file {self.path.name}: layer {index} is damaged")

    def read_into(self, entry: ChunkKV) -> None:
        """Every layer, verified, into the entry (which stops being lazy)."""
        for layer in range(self.num_layers):
            keys, values = self.layer(layer)
            entry.keys[layer].copy_(keys)
            entry.values[layer].copy_(values)
        entry.reader = None

    def rows(self, index: int, rows: torch.Tensor, max_gap: int = 8) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Only these token rows of one layer (ascending local indices), read as contiguous runs
        (through gaps up to max_gap rows) and verified row by row: (start, end, keys, values)."""
        out = []
        keys_slice, values_slice = self._handle.get_slice("keys"), self._handle.get_slice("values")
        for start, end in _runs(rows, max_gap):
            keys = keys_slice[index : index + 1, start:end]
            values = values_slice[index : index + 1, start:end]
            self._verify(index, start, end, keys, values)
            out.append((start, end, keys[0], values[0]))
            self.rows_read += end - start
        return out

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _runs(rows: torch.Tensor, max_gap: int) -> list[tuple[int, int]]:
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


class DiskTier:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending: queue.Queue[tuple[str, ChunkKV] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="ragcache-disk-writer", daemon=True)
        self._writer.start()
        self.corrupt_files_seen = 0

    def path_for(self, digest: str) -> Path:
        return self.directory / digest[:2] / f"{digest}{_SUFFIX}"

    def __contains__(self, digest: str) -> bool:
        return self.path_for(digest).is_file()

    def put(self, digest: str, entry: ChunkKV) -> None:
        self._pending.put((digest, entry))

    def flush(self) -> None:
        self._pending.join()

    def _write_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is not None:
                    self._write(*item)
            except OSError as exc:
                log.warning("could not write chunk cache file: %s", exc)
            finally:
                self._pending.task_done()

    def _write(self, digest: str, entry: ChunkKV) -> None:
        path = self.path_for(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        keys, values = entry.keys.cpu().contiguous(), entry.values.cpu().contiguous()
        scores = entry.scores if entry.scores is not None else frequency_scores(keys, values)
        tensors = {"keys": keys, "values": values, "token_ids": entry.token_ids.cpu().contiguous(),
                   "tune_scores": scores.float().cpu().contiguous(), "row_sums": _row_sums(keys, values)}
        meta = {"digest": digest, "checksum": _checksum(tensors), "chunk_id": entry.chunk_id or "",
                "tenant": entry.tenant, **entry.meta}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)

    def get(self, digest: str) -> ChunkKV | None:
        path = self.path_for(digest)
        if not path.is_file():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
            tensors = load_file(str(path))
            if meta.get("digest") != digest or meta.get("checksum") != _checksum(tensors):
                raise ValueError("checksum mismatch")
        except Exception as exc:  # any damage at all must end as a miss, never a crash
            self.forget_damaged(path, str(exc))
            return None
        extra = {k: v for k, v in meta.items() if k not in _RESERVED_META}
        return ChunkKV(tensors["keys"], tensors["values"], tensors["token_ids"],
                       meta.get("chunk_id") or None, meta.get("tenant", ""), extra, scores=tensors.get("tune_scores"))

    def forget_damaged(self, path: Path, why: str) -> None:
        self.corrupt_files_seen += 1
        log.warning("chunk cache file %s is damaged (%s); recomputing it", path.name, why)
        path.unlink(missing_ok=True)

    def lazy(self, digest: str) -> ChunkKV | None:
        """The entry with its token ids and shapes read now and its KV still on disk, to be read a
        layer at a time (`ChunkKV.reader`); None if absent, damaged, or written before row
        checksums existed (then `get` reads it whole)."""
        path = self.path_for(digest)
        if not path.is_file():
            return None
        try:
            from safetensors import safe_open

            handle = safe_open(str(path), framework="pt")
            meta = handle.metadata() or {}
            names = set(handle.keys())
            if meta.get("digest") != digest or "row_sums" not in names:
                return None
            token_ids = handle.get_tensor("token_ids")
            row_sums = handle.get_tensor("row_sums")
            scores = handle.get_tensor("tune_scores") if "tune_scores" in names else None
            shape = handle.get_slice("keys").get_shape()
            dtype = handle.get_slice("keys").get_dtype()
            if len(shape) != 4 or tuple(row_sums.shape) != tuple(shape[:2]) or shape[1] != token_ids.shape[0]:
                raise ValueError("shapes disagree with the row checksums")
        except Exception as exc:  # a damaged header is a miss, like in `get`
            self.forget_damaged(path, str(exc))
            return None
        torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(dtype)
        if torch_dtype is None:
            return None
        keys = torch.empty(shape, dtype=torch_dtype)
        values = torch.empty(shape, dtype=torch_dtype)
        extra = {k: v for k, v in meta.items() if k not in _RESERVED_META}
        entry = ChunkKV(keys, values, token_ids, meta.get("chunk_id") or None, meta.get("tenant", ""), extra,
                        scores=scores)
        entry.reader = LayerReader(self, digest, path, handle, row_sums)
        return entry

    def remove(self, digest: str) -> bool:
        path = self.path_for(digest)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        return existed

    def digests(self) -> list[str]:
        return [p.name[: -len(_SUFFIX)] for p in self.directory.glob(f"*/*{_SUFFIX}")]

    def metadata(self, digest: str) -> dict[str, str]:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path_for(digest)), framework="pt") as handle:
                return handle.metadata() or {}
        except Exception:
            return {}

    @property
    def bytes_used(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob(f"*/*{_SUFFIX}"))

    def clear(self) -> None:
        self.flush()
        for digest in self.digests():
            self.remove(digest)
