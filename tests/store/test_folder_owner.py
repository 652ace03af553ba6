"""Which processes hold a disk-tier folder, with real processes: `ragcache cache clear` refuses
while any live process has the folder open, whatever other processes opened it and left since;
a holder that is killed, or closes its tier, frees the folder; a pid written in `.owner` by a
process long gone, and reused since, holds nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine_sidecar.store.disk import OWNER_FILE, DiskTier, folder_owner
from tests.cli.test_cli_errors import run_cli

ROOT = Path(__file__).resolve().parents[2]
PASSAGE = "Mount Fuji is 3,776 m high. The Nile flows north through eleven countries."

# a process that opens an Engine on the folder (model argv[2]) or a bare tier, says "ready" and
# waits for a line on stdin; "close" as argv[3]: the tier is closed before it says so
HOLDER = """
import sys
from pathlib import Path
folder, model, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if model == "-":
    from engine_sidecar.store.disk import DiskTier
    tier = DiskTier(folder)
    if how == "close":
        tier.close()
    print("ready", flush=True)
    sys.stdin.readline()
else:
    from engine_sidecar import Engine
    with Engine.from_pretrained(model, dtype="float32", cache_dir=folder) as engine:
        engine.warm([sys.argv[4]])
        engine.cache.store.flush()
        print("ready", flush=True)
        sys.stdin.readline()
"""


def _holder(folder: Path, model: str = "-", how: str = "hold") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), model, how, PASSAGE], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _let_go(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0


def test_cache_clear_refuses_while_a_holder_lives_though_a_warm_up_opened_the_folder_and_exited(
        tiny_llama_dir, tmp_path):
    kv = tmp_path / "kv"
    holder = _holder(kv, str(tiny_llama_dir))
    try:
        chunk = tmp_path / "chunk.txt"
        chunk.write_text("The Danube flows east through ten countries into the Black Sea.")
        warmed = run_cli("warm", "--model", str(tiny_llama_dir), "--cache-dir", str(kv), str(chunk), home=tmp_path)
        assert warmed.returncode == 0, warmed.stderr
        files = sorted(kv.rglob("*.kv.safetensors"))
        assert len(files) >= 2  # the holder's passage and the warm-up's
        refused = run_cli("cache", "clear", "--cache-dir", str(kv), home=tmp_path)
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr
        assert f"pid {holder.pid}" in lines[0] and "DELETE" in lines[0]
        assert sorted(kv.rglob("*.kv.safetensors")) == files  # nothing deleted under the holder
    finally:
        _let_go(holder)
    cleared = run_cli("cache", "clear", "--cache-dir", str(kv), home=tmp_path)
    assert cleared.returncode == 0 and f"removed {len(files)} cache entries" in cleared.stdout, cleared.stderr


def test_every_live_holder_counts_and_the_folder_is_free_once_they_are_gone(tmp_path):
    kv = tmp_path / "kv"
    first = _holder(kv)
    second = _holder(kv)
    assert folder_owner(kv) in {first.pid, second.pid}
    _let_go(second)  # it wrote its pid into `.owner` last: the first still holds the folder
    assert folder_owner(kv) == first.pid
    first.send_signal(signal.SIGKILL)  # no clean-up at all: the kernel lets go of its lock
    first.wait(timeout=60)
    assert folder_owner(kv) is None


def test_a_closed_tier_lets_go_of_the_folder_while_its_process_lives(tmp_path):
    kv = tmp_path / "kv"
    closed = _holder(kv, how="close")
    try:
        assert folder_owner(kv) is None
    finally:
        _let_go(closed)


def test_a_live_pid_left_in_the_owner_file_holds_nothing(tmp_path):
    """`.owner` of a process long gone whose pid now belongs to another live process (here the
    test runner's parent): no process holds the folder, so nothing refuses."""
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / OWNER_FILE).write_text(str(os.getppid()))
    assert folder_owner(kv) is None
    assert run_cli("cache", "clear", "--cache-dir", str(kv), home=tmp_path).returncode == 0


def test_this_processes_own_tiers_never_count_and_share_one_hold(tmp_path):
    kv = tmp_path / "kv"
    one, two = DiskTier(kv), DiskTier(kv)
    assert folder_owner(kv) is None  # ours
    one.close()
    holder = _holder(kv)
    try:
        two.close()  # the last of ours: the other process's lock is its own and stays
        assert folder_owner(kv) == holder.pid
    finally:
        _let_go(holder)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/locks")
def test_a_holder_keeps_one_shared_lock_however_many_tiers_it_opens(tmp_path):
    kv = tmp_path / "kv"
    tiers = [DiskTier(kv) for _ in range(3)]
    inode = (kv / OWNER_FILE).stat().st_ino
    ours = [line for line in Path("/proc/locks").read_text().splitlines()
            if f" {os.getpid()} " in line and line.split()[5].endswith(f":{inode}")]
    assert len(ours) == 1 and " READ " in ours[0], ours
    for tier in tiers:
        tier.close()


def test_a_release_from_a_finalizer_inside_a_claim_never_deadlocks(tmp_path):
    """A tier collected by the garbage collector while this thread is inside a claim (which holds
    the module's lock) runs its release right there: it must not wait for that lock, and the
    release is applied by the next claim or query."""
    import threading

    from engine_sidecar.store import folder_claim

    (tmp_path / "a").mkdir()
    release = folder_claim.claim(tmp_path / "a")
    done = threading.Event()

    def release_inside_the_lock() -> None:
        with folder_claim._lock:  # where a finalizer would run: in a claim, on the lock's thread
            release()
        done.set()

    worker = threading.Thread(target=release_inside_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert done.is_set(), "the release waited forever for the lock its own thread holds"
    assert folder_owner(tmp_path / "a") is None  # the next query applied it
    key = (tmp_path / "a" / OWNER_FILE).stat()
    assert (key.st_dev, key.st_ino) not in folder_claim._held
    assert not folder_claim._pending
