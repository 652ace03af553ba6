"""Fault injection on the chunk store with the real engine: a `ragcache serve` killed
with SIGKILL while it writes chunk KV, then restarted on the same folder; bytes flipped in cache
files; a full disk (a real 1 MiB tmpfs where this machine lets us mount one, else ENOSPC
injected). Every case ends with answers equal to a fresh engine's and the fault counted."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine_sidecar import Engine
from engine_sidecar.execution.policies import CacheTunePolicy
from engine_sidecar.store import disk as disk_module
from tests.server.test_server_process import ServerProcess

WORDS = ("river delta basin canyon glacier harbor island lagoon meadow plateau ridge summit tundra valley "
         "volcano estuary fjord marsh prairie savanna").split()


def passage(i: int, sentences: int = 12) -> str:
    return " ".join(f"Fact {i}.{j}: the {WORDS[(i + j) % len(WORDS)]} near site {i * 31 + j} is "
                    f"{WORDS[(i * 7 + j) % len(WORDS)]}-shaped." for j in range(sentences))


PASSAGES = [passage(i) for i in range(3)]
PROMPT = {"chunks": PASSAGES, "question": "Which site is a glacier?"}


def engine(model_dir: Path, cache: Path | None, **options) -> Engine:
    return Engine.from_pretrained(model_dir, device="cpu", dtype="float32", cache_dir=cache, disk=cache is not None,
                                  prefix_tree=False, **options)


def cache_files(cache: Path, pattern: str = "*.kv.safetensors") -> list[Path]:
    return sorted(cache.rglob(pattern)) if cache.exists() else []


def temp_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.name.endswith(".tmp")] if cache.exists() else []


# --- CacheTune: a sparse disk read with a non-default cutoff ----------------------------------------
def strip_scores(cache: Path) -> None:
    """Rewrite every file as one written before scores were stored (no tune_scores)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for path in cache_files(cache):
        with safe_open(str(path), framework="pt") as handle:
            meta = dict(handle.metadata())
        tensors = load_file(str(path))
        del tensors["tune_scores"]
        meta.pop("aux_checksum")
        meta["checksum"] = disk_module._checksum(tensors)
        save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("case", ["cutoff", "no-scores"])
def test_cachetune_from_disk_with_prefetch_equals_a_synchronous_load(tiny_llama_dir, tmp_path, case):
    """CacheTune reads a lazily loaded chunk whole to score it when its stored scores do not fit
    (another cutoff, or none stored): the executor must still get that chunk's KV (it got an
    uninitialised buffer: wrong or NaN logits)."""
    cache = tmp_path / "kv"
    with engine(tiny_llama_dir, cache) as warm:
        warm.warm(PASSAGES)
        warm.generate(PROMPT, {"max_tokens": 1}, policy="cachetune:0.3")  # also stores the template prefix
        warm.cache.store.flush()
    if case == "no-scores":
        strip_scores(cache)
    policy = CacheTunePolicy(0.3, cutoff=0.3 if case == "cutoff" else 0.5)
    with engine(tiny_llama_dir, cache, prefetch=False) as sync:
        expected, stats = sync.prefill_logits(PROMPT, policy=policy)
        assert stats.chunk_hits == 3
    with engine(tiny_llama_dir, cache, prefetch=True) as prefetched:
        logits, stats = prefetched.prefill_logits(PROMPT, policy=policy)
        assert stats.chunk_hits == 3 and prefetched.cache.store.hits_disk >= 3
    assert not torch.isnan(logits).any()
    assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()


# --- flipped bytes --------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [True, False])
def test_flipped_bytes_in_every_file_are_detected_recomputed_and_counted(tiny_llama_dir, tmp_path, prefetch):
    cache = tmp_path / "kv"
    with engine(tiny_llama_dir, cache) as warm:
        warm.warm(PASSAGES)
        warm.cache.store.flush()
    with engine(tiny_llama_dir, None) as fresh:
        expected, _ = fresh.prefill_logits(PROMPT, policy="cacheblend")
    files = cache_files(cache)
    assert len(files) == 3
    for i, path in enumerate(files):  # one flip each: the KV data, the header, the metadata
        data = bytearray(path.read_bytes())
        offset = (len(data) - 40, 4, data.index(b"tenant"))[i]
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
    with engine(tiny_llama_dir, cache, prefetch=prefetch) as damaged:
        logits, stats = damaged.prefill_logits(PROMPT, policy="cacheblend")
        assert stats.chunk_hits == 0 and stats.chunk_misses == 3  # nothing damaged was served
        assert damaged.cache.store.stats().corrupt_files == 3
        # recomputed in place, exactly as a fresh engine computes a miss
        assert torch.allclose(logits, expected, atol=1e-5)
        assert not any(p.exists() for p in files)


# --- a full disk ----------------------------------------------------------------------------------
def serve_through_a_full_disk(model_dir: Path, cache: Path) -> Engine:
    eng = engine(model_dir, cache)
    chunks = [passage(i, sentences=20) for i in range(3, 12)]
    eng.warm(chunks)
    assert eng.cache.store.disk.flush(timeout_s=60)
    with engine(model_dir, None) as ram_only:  # the same chunks warmed, no disk at all
        ram_only.warm(chunks[-3:])
        expected, _ = ram_only.prefill_logits({"chunks": chunks[-3:], "question": "Which site?"}, policy="reuse")
    got, stats = eng.prefill_logits({"chunks": chunks[-3:], "question": "Which site?"}, policy="reuse")
    assert stats.chunk_hits == 3  # served from RAM although the disk refused them
    assert torch.allclose(got, expected, atol=1e-5)
    assert eng.cache.store.disk.flush(timeout_s=60)  # the template prefix, stored by that request
    assert temp_files(cache) == []
    return eng


def test_a_full_disk_fails_writes_cleanly_and_serving_continues(tiny_llama_dir, tmp_path, monkeypatch):
    """ENOSPC injected half-way through every write (the portable version of the tmpfs test)."""

    def full(path, data):
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(disk_module, "_write_file", full)
    eng = serve_through_a_full_disk(tiny_llama_dir, tmp_path / "kv")
    try:
        stats = eng.cache.store.stats()
        # every write failed (9 chunks and the template prefix), and left nothing behind
        assert stats.disk_write_failures == stats.ram_entries == 10 and stats.disk_entries == 0
        assert cache_files(tmp_path / "kv") == []
    finally:
        eng.close()


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 1 MiB tmpfs mounted for this test; skipped where mounting is not allowed."""
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the ENOSPC-injection test covers this case)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_real_full_filesystem_fails_writes_cleanly_and_serving_continues(tiny_llama_dir, tiny_filesystem):
    cache = tiny_filesystem / "kv"
    eng = serve_through_a_full_disk(tiny_llama_dir, cache)  # 9 files of ~320 KB on 1 MiB
    try:
        stats = eng.cache.store.stats()
        assert stats.disk_write_failures >= 5 and stats.disk_entries >= 1
        assert stats.disk_write_failures + stats.disk_entries == stats.ram_entries == 10  # each written or counted
        assert "No space left" in eng.cache.store.disk.counters.errors[-1]
        on_disk = sum(p.stat().st_size for p in cache_files(cache))
        assert stats.disk_bytes == on_disk  # only whole files, each in the index
        restarted = engine(tiny_llama_dir, cache)
        assert restarted.cache.store.stats().disk_entries == stats.disk_entries
        restarted.close()
    finally:
        eng.close()


# --- SIGKILL while writing ------------------------------------------------------------------------
def generate(base: str, chunks: list[str]) -> list[int]:
    body = {"prompt": {"chunks": chunks, "question": "Which site is a glacier?"},
            "sampling": {"max_tokens": 6, "temperature": 0}, "policy": "cacheblend"}
    response = httpx.post(base + "/v1/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["token_ids"]


SERVE_FLAGS = ("--no-prefix-tree", "--precompute", "inline", "--ram-cache-gb", "0.01")


def test_sigkill_while_writing_then_restart_serves_nothing_damaged(tiny_llama_dir, tmp_path):
    """Kill -9 a real sidecar while its disk writer works, damage two files the way a torn write
    on a weaker filesystem would, restart on the same folder: no temp file is left, nothing
    damaged is served (answers equal a fresh sidecar's), the damage is counted in /metrics."""
    cache = tmp_path / "kv"
    chunks = [passage(i, sentences=40) for i in range(40, 64)]  # ~800 tokens each
    server = ServerProcess(tiny_llama_dir, cache, tmp_path / "a.log", *SERVE_FLAGS).start()
    caught_temp = False
    try:
        def warm_all() -> None:
            for start in range(0, len(chunks), 2):
                try:
                    httpx.post(server.base + "/v1/chunks/warm", json={"chunks": chunks[start : start + 2], "neighbours": 0},
                               timeout=60)
                except httpx.HTTPError:
                    return  # killed

        writer = threading.Thread(target=warm_all, daemon=True)
        writer.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and writer.is_alive():
            if len(cache_files(cache)) >= 6 and temp_files(cache):
                break
            time.sleep(0.001)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=30)
        writer.join(timeout=60)
        caught_temp = bool(temp_files(cache))
    finally:
        server.kill()
    survivors = cache_files(cache)
    assert len(survivors) >= 3, "the sidecar was killed before it wrote anything"
    survivors[0].write_bytes(survivors[0].read_bytes()[: survivors[0].stat().st_size // 2])  # torn
    data = bytearray(survivors[1].read_bytes())
    data[len(data) // 2] ^= 0x10
    survivors[1].write_bytes(bytes(data))  # a flipped bit
    print(f"killed with a temp file in flight: {caught_temp}; {len(survivors)} files survived")

    with ServerProcess(tiny_llama_dir, cache, tmp_path / "b.log", *SERVE_FLAGS) as restarted:
        assert temp_files(cache) == []
        answers = [generate(restarted.base, chunks[i : i + 2]) for i in range(0, len(chunks), 2)]
        stats = httpx.get(restarted.base + "/v1/cache/stats", timeout=30).json()
        assert stats["corrupt_files"] == 2 and stats["hits_disk"] >= len(survivors) - 2
        assert restarted.metric("ragcache_store_disk_events_total", event="corrupt") == 2
    with ServerProcess(tiny_llama_dir, tmp_path / "fresh", tmp_path / "c.log", *SERVE_FLAGS) as fresh:
        # each chunk alone, as the killed sidecar computed them
        httpx.post(fresh.base + "/v1/chunks/warm", json={"chunks": chunks, "neighbours": 0}, timeout=300).raise_for_status()
        assert answers == [generate(fresh.base, chunks[i : i + 2]) for i in range(0, len(chunks), 2)]
