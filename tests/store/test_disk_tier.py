"""The disk tier's bounds and faults: a byte budget with LRU eviction over an index
built once at start-up, crash leftovers removed, fsync before the rename, a writer that survives
any failure, a flush that never blocks forever, a full disk, damaged files never served."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine_sidecar.store import disk as disk_module
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.disk import OWNER_FILE, DamagedCacheFile, DiskTier
from engine_sidecar.store.entry import CacheKey, ChunkKV


def chunk(seed: int, tokens: int = 6, layers: int = 2, chunk_id: str | None = None) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(layers, tokens, 2, 4, generator=g), torch.randn(layers, tokens, 2, 4, generator=g),
                   torch.arange(tokens) + seed, chunk_id)


def digest(i: int) -> str:
    return f"{i:02x}" * 20


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file() and p.name != OWNER_FILE)


def one_file_size(tmp_path: Path) -> int:
    probe = DiskTier(tmp_path / "probe")
    probe.put(digest(0), chunk(0))
    assert probe.flush()
    return probe.bytes_used


def test_budget_evicts_least_recently_used_and_survives_a_restart(tmp_path):
    size = one_file_size(tmp_path)
    tier = DiskTier(tmp_path / "kv", capacity_bytes=3 * size)
    for i in range(3):
        tier.put(digest(i), chunk(i))
        tier.flush()
        time.sleep(0.01)  # distinct mtimes
    assert tier.get(digest(0)) is not None  # used: now the most recent
    tier.put(digest(3), chunk(3))
    tier.flush()
    assert set(tier.digests()) == {digest(0), digest(2), digest(3)} and tier.counters.evictions == 1
    assert tier.bytes_used == 3 * size == sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.safetensors"))
    assert not tier.path_for(digest(1)).exists()
    # the index is rebuilt from the folder; a lower budget at start-up drops the least recently used
    again = DiskTier(tmp_path / "kv", capacity_bytes=2 * size)
    assert set(again.digests()) == {digest(0), digest(3)} and again.bytes_used == 2 * size
    assert again.counters.evictions == 1
    unlimited = DiskTier(tmp_path / "kv", capacity_bytes=0)
    for i in range(4, 8):
        unlimited.put(digest(i), chunk(i))
    unlimited.flush()
    assert len(unlimited) == 6 and unlimited.counters.evictions == 0


def test_an_entry_over_the_whole_budget_is_not_written(tmp_path):
    size = one_file_size(tmp_path)
    tier = DiskTier(tmp_path / "kv", capacity_bytes=size + 100)
    tier.put(digest(1), chunk(1))
    tier.put(digest(2), chunk(2, tokens=60))  # far over the budget: skipped, nothing evicted for it
    tier.flush()
    assert tier.digests() == [digest(1)] and tier.counters.evictions == 0


def test_stats_lookups_and_deletes_never_walk_the_folder(tmp_path, monkeypatch):
    store = ChunkStore(1 << 20, tmp_path / "kv", torch.device("cpu"))
    key = CacheKey("m", "t", "x", "", "isolated")
    store.put(key, chunk(1, chunk_id="doc-1"))
    store.put(CacheKey("m", "t", "y", "", "isolated"), chunk(2, chunk_id="doc-2"))
    store.flush()
    restarted = ChunkStore(1 << 20, tmp_path / "kv", torch.device("cpu"), 1 << 20)  # index built here, once

    def no_walk(*args, **kwargs):
        raise AssertionError("the folder was walked")

    for name in ("glob", "rglob", "iterdir"):
        monkeypatch.setattr(Path, name, no_walk)
    monkeypatch.setattr(os, "scandir", no_walk)
    monkeypatch.setattr(os, "walk", no_walk)
    stats = restarted.stats()
    assert stats.disk_entries == 2 and stats.disk_bytes > 0 and stats.disk_capacity_bytes == 1 << 20
    assert restarted.contains(key) and restarted.disk.metadata(key.digest)["chunk_id"] == "doc-1"
    assert restarted.delete("doc-1") == 1 and restarted.stats().disk_entries == 1
    assert not restarted.contains(key)


def test_orphan_temp_files_are_removed_at_start_up_but_not_a_live_writers(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    tier.put(digest(1), chunk(1))
    tier.flush()
    final = tier.path_for(digest(1))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    orphan = final.with_name(f".{digest(2)}.kv.safetensors.{dead_pid}.1.tmp")
    orphan.write_bytes(b"half a file")
    no_pid = final.with_name(f".{digest(3)}.kv.safetensors.tmp")
    no_pid.write_bytes(b"")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = final.with_name(f".{digest(4)}.kv.safetensors.{live.pid}.1.tmp")
        busy.write_bytes(b"being written by another process")
        again = DiskTier(tmp_path / "kv")
        assert not orphan.exists() and not no_pid.exists() and busy.exists()
        assert again.counters.orphans_removed == 2 and again.digests() == [digest(1)]
    finally:
        live.kill()
        live.wait()


def test_the_temp_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(src, dst):
        calls.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(disk_module.os, "fsync", fsync)
    monkeypatch.setattr(disk_module.os, "replace", replace)
    tier = DiskTier(tmp_path / "kv")
    tier.put(digest(1), chunk(1))
    tier.flush()
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc to tell a folder's fd from a file's")
    assert calls == ["fsync-file", "rename", "fsync-dir"]


class Exploding(ChunkKV):
    """An entry whose KV cannot even be read: the write fails with a non-OSError."""

    @property
    def nbytes(self) -> int:
        return 100


def test_the_writer_survives_any_exception_and_flush_returns(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    bad = Exploding(torch.zeros(2, 3, 2, 4), torch.zeros(2, 3, 2, 4), torch.arange(3))
    bad.keys = "not a tensor"  # AttributeError inside the writer
    tier.put(digest(1), bad)
    done = threading.Event()
    threading.Thread(target=lambda: (tier.flush(), done.set()), daemon=True).start()
    assert done.wait(20), "flush blocked: the writer thread died"
    assert tier.counters.write_failures == 1 and digest(1) not in tier
    tier.put(digest(2), chunk(2))  # the same writer still writes
    assert tier.flush() and digest(2) in tier and tier.get(digest(2)) is not None
    assert files(tmp_path / "kv") == [f"{digest(2)}.kv.safetensors"]


def test_flush_gives_up_after_its_bound_on_a_stuck_disk(tmp_path, monkeypatch):
    release = threading.Event()
    real_write = disk_module._write_file

    def stuck(path, data):
        release.wait(30)
        real_write(path, data)

    monkeypatch.setattr(disk_module, "_write_file", stuck)
    tier = DiskTier(tmp_path / "kv")
    tier.put(digest(1), chunk(1))
    started = time.monotonic()
    assert tier.flush(timeout_s=0.3) is False
    assert time.monotonic() - started < 5
    release.set()
    assert tier.flush(timeout_s=20) and digest(1) in tier


def test_a_full_write_queue_drops_entries_instead_of_growing(tmp_path, monkeypatch):
    release = threading.Event()
    real_write = disk_module._write_file
    monkeypatch.setattr(disk_module, "_write_file", lambda p, d: (release.wait(30), real_write(p, d)))
    tier = DiskTier(tmp_path / "kv", max_pending_bytes=3 * chunk(0).nbytes)
    for i in range(8):
        tier.put(digest(i), chunk(i))
    release.set()
    assert tier.flush(timeout_s=20)
    assert tier.counters.writes_dropped >= 4 and len(tier) == 8 - tier.counters.writes_dropped


def enospc_after_half(path, data):
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_full_disk_fails_the_write_cleanly_and_the_entry_is_served_from_ram(tmp_path, monkeypatch):
    store = ChunkStore(1 << 20, tmp_path / "kv", torch.device("cpu"))
    key = CacheKey("m", "t", "x", "", "isolated")
    monkeypatch.setattr(disk_module, "_write_file", enospc_after_half)
    store.put(key, chunk(1))
    assert store.disk.flush()
    assert files(tmp_path / "kv") == []  # no partial file, no temp file
    stats = store.stats()
    assert stats.disk_write_failures == 1 and stats.disk_entries == 0 and stats.disk_bytes == 0
    assert "No space left" in store.disk.counters.errors[-1]
    assert torch.equal(store.get(key).keys, chunk(1).keys)  # serving continues from RAM
    monkeypatch.undo()  # space again: the next write lands
    store.put(CacheKey("m", "t", "y", "", "isolated"), chunk(2))
    assert store.disk.flush() and store.stats().disk_entries == 1


def read_back(tier: DiskTier, key: str, lazy: bool) -> ChunkKV | None:
    """As the store reads: lazily (layer by layer, verified) with a whole-file read as fallback."""
    if lazy:
        entry = tier.lazy(key)
        if entry is not None:
            try:
                entry.reader.read_into(entry)
            except DamagedCacheFile:
                return None
            finally:
                entry.reader.close()
            return entry
    return tier.get(key)


def test_flipped_bytes_anywhere_are_never_served(tmp_path):
    """Byte flips all over a file (header, metadata, every tensor): each is caught (a miss,
    counted, the file deleted) or harmless (what is read equals what was written)."""
    original = chunk(7, tokens=9, layers=3, chunk_id="doc-7")
    original.tenant, original.meta = "acme", {"variant": "v1"}
    tier = DiskTier(tmp_path / "kv")
    tier.put(digest(1), original)
    tier.flush()
    path = tier.path_for(digest(1))
    clean = path.read_bytes()
    caught = harmless = 0
    for offset in range(0, len(clean), max(1, len(clean) // 97)):
        for lazy in (False, True):
            damaged = bytearray(clean)
            damaged[offset] ^= 0x5A
            path.write_bytes(bytes(damaged))
            tier = DiskTier(tmp_path / "kv")
            got = read_back(tier, digest(1), lazy)
            if got is None:
                caught += 1
                assert tier.counters.corrupt_files == 1 and not path.exists() and digest(1) not in tier
            else:
                harmless += 1
                assert torch.equal(got.keys, original.keys) and torch.equal(got.values, original.values)
                assert torch.equal(got.token_ids, original.token_ids)
                assert (got.chunk_id, got.tenant, got.meta) == ("doc-7", "acme", {"variant": "v1"})
            path.write_bytes(clean)
    assert caught >= 150, (caught, harmless)
