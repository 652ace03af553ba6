"""Which processes have a disk-tier folder open, so `ragcache cache clear` never deletes the files
of a running sidecar.

Every process with a tier open on a folder holds a shared POSIX record lock on the folder's
`.owner` file. Shared locks coexist, so `ragcache warm --cache-dir D` still writes into a folder
a sidecar serves, and neither overwrites the other's claim: `folder_owner` asks the kernel
(F_GETLK) whether another process holds a lock and which, so a second process that opened the
folder and exited cannot hide the first. The kernel drops a process's locks when it ends, however
it ends, and a reused pid holds no lock: nothing stale is ever reported.

POSIX record locks belong to the process, and closing any descriptor of the file drops all of
them: so this process opens each folder's `.owner` once, shared by its tiers (counted), and
`folder_owner` asks through that descriptor. Nothing else in the process may open the file.

Where the kernel cannot be asked (no `fcntl`, a `struct flock` layout not known here), the file
holds the pid of the newest process that opened the folder, checked for being alive.
"""

from __future__ import annotations

import functools
import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

OWNER_FILE = ".owner"

# `struct flock` (large-file offsets, as Python is built): its C layout and field order
_FLOCK: tuple[str, tuple[str, ...]] | None = None
if sys.platform.startswith("linux"):
    _FLOCK = ("hhqqi", ("type", "whence", "start", "len", "pid"))
elif sys.platform == "darwin" or "bsd" in sys.platform:
    _FLOCK = ("qqihh", ("start", "len", "pid", "type", "whence"))


@dataclass
class _Held:
    """One folder's `.owner` as this process holds it: its descriptors (normally one) and how many
    tiers have it open."""

    fds: list[int] = field(default_factory=list)
    tiers: int = 0


_lock = threading.Lock()  # guards `_held`, and keeps a query from opening a file a claim holds
_held: dict[tuple[int, int], _Held] = {}  # (st_dev, st_ino) of an `.owner` -> this process's hold
# releases not yet applied: a release may run from a garbage-collection finalizer on a thread that
# already holds `_lock` (a tier collected while a claim allocates), so it never waits for the lock;
# whoever holds the lock applies them before letting go
_pending: deque[tuple[int, int]] = deque()


def claim(directory: Path) -> Callable[[], None]:
    """Hold `directory` for this process until the returned release is called (once). A folder
    whose `.owner` cannot be created (read-only) is still served; only `cache clear`'s check
    loses it."""
    path = Path(directory) / OWNER_FILE
    with _lock:
        _apply_pending()
        key = _key_held(path)
        if key is None:
            fd = _open(path)
            if fd is None:
                _apply_pending()
                return _nothing
            key = _hold(fd)
        _held[key].tiers += 1
        _apply_pending()
    _apply_pending_if_free()
    return functools.partial(_release, key)


def folder_owner(directory: Path) -> int | None:
    """The pid of another live process holding this folder (a sidecar, a warm-up), if any; this
    process's own tiers never count. 0 for a holder whose pid is not visible here (another pid
    namespace)."""
    path = Path(directory) / OWNER_FILE
    try:
        with _lock:
            _apply_pending()
            key = _key_held(path)
            if key is not None:
                return _holder(_held[key].fds[0])
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return None
            try:
                return _holder(fd)
            finally:
                os.close(fd)  # this process holds no lock on the file: closing drops nothing
                _apply_pending()
    finally:
        _apply_pending_if_free()


def _nothing() -> None:
    pass


def _key_held(path: Path) -> tuple[int, int] | None:
    """The file's key in `_held` if this process holds it already (found without opening it)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino)
    return key if key in _held else None


def _open(path: Path) -> int | None:
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            return os.open(path, flags, 0o644)
        except OSError:
            continue
    return None


def _hold(fd: int) -> tuple[int, int]:
    """Lock the newly opened file shared, write this pid into it, and keep the descriptor."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    if fcntl is not None:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # a lock the kernel refuses (a filesystem without them): the pid alone then
            pass
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:  # opened read-only
        pass
    _held.setdefault(key, _Held()).fds.append(fd)  # replaced under the same path: kept, closing it would unlock
    return key


def _release(key: tuple[int, int]) -> None:
    _pending.append(key)
    _apply_pending_if_free()


def _apply_pending_if_free() -> None:
    """Apply the pending releases unless another holder of the lock will (it applies them before
    letting go); retried after taking the lock, for a release queued as the holder let go."""
    while _pending and _lock.acquire(blocking=False):
        try:
            _apply_pending()
        finally:
            _lock.release()


def _apply_pending() -> None:
    """With `_lock` held: drop one tier's hold per pending release; the last one closes the file."""
    while _pending:
        key = _pending.popleft()
        held = _held.get(key)
        if held is None:
            continue
        held.tiers -= 1
        if held.tiers > 0:
            continue
        del _held[key]
        for fd in held.fds:
            try:
                os.close(fd)  # drops this process's lock
            except OSError:
                pass


def _holder(fd: int) -> int | None:
    """Who else holds a lock on the open file: asked of the kernel where it can be."""
    if fcntl is None or _FLOCK is None:
        return _pid_in_file(fd)
    layout, names = _FLOCK
    query = dict(type=fcntl.F_WRLCK, whence=os.SEEK_SET, start=0, len=0, pid=0)
    # room past the struct: the kernel writes the whole C struct, padding included
    packed = struct.pack(layout, *(query[n] for n in names)) + bytes(16)
    try:
        answer = dict(zip(names, struct.unpack_from(layout, fcntl.fcntl(fd, fcntl.F_GETLK, packed)), strict=True))
    except OSError:
        return _pid_in_file(fd)
    return None if answer["type"] == fcntl.F_UNLCK else max(0, answer["pid"])


def _pid_in_file(fd: int) -> int | None:
    """The pid the file holds, if that process is alive (read through `fd`: opening the file
    again and closing it would drop this process's lock)."""
    try:
        pid = int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if other_process_alive(pid) else None


def other_process_alive(pid: int) -> bool:
    """Whether `pid` is another process that may still be alive (never this one: a pid of ours in
    a file is from an earlier process that had the same pid)."""
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's live process, or no way to tell
        return True
    return True
