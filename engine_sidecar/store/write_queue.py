"""The background writer shared by the disk and Redis tiers: a byte-bounded FIFO of keyed work
items, run one at a time on a daemon thread, so a request never waits on a slow tier.

Why not the standard library: `queue.Queue` bounds by item count, not bytes, cannot take back a
queued item (a deleted chunk's pending write must not recreate it), and `join()` has no timeout
(a flush must never block forever on a stuck disk or a frozen Redis). `ThreadPoolExecutor` has an
unbounded queue and joins its (non-daemon) workers at interpreter exit, so a stuck write would
hang shutdown. What is left is small enough to write here once, instead of once per tier.

Semantics (those the tiers had):
- an item that would take the queue over `max_pending_bytes` is dropped, never blocked on (a tier
  slower than the requests must not grow memory or stall them); an empty queue takes any item, so
  one entry larger than the bound is still written;
- `flush` waits for every item queued so far, including the one being run, up to a bound;
- `discard` takes back queued items of some keys and marks the one being run as cancelled: the
  tier's `on_cancelled` runs once it is done (for the disk tier: delete the file it just wrote);
- `close` finishes what is queued and ends the thread: at interpreter exit a daemon thread is
  stopped wherever it is, and one stopped inside torch aborts the whole process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Generic, TypeVar

log = logging.getLogger("ragcache.store")

T = TypeVar("T")


class WriteQueue(Generic[T]):
    """`run(key, item)` for each accepted item, in order, on one daemon thread named `name`.
    `run` should handle its own failures (its result is ignored); anything it raises is logged and
    the writer goes on."""

    def __init__(self, name: str, run: Callable[[str, T], object], max_pending_bytes: int,
                 on_cancelled: Callable[[str], None] | None = None):
        self.name = name
        self.max_pending_bytes = max_pending_bytes
        self._run, self._on_cancelled = run, on_cancelled
        self._cond = threading.Condition()  # guards everything below
        self._pending: deque[tuple[str, T, int]] = deque()
        self._pending_bytes = 0
        self._in_flight = 0  # queued + being run: what `flush` waits for
        self._running: str | None = None  # the key being run now
        self._cancelled = False  # the item being run was discarded meanwhile
        self._thread: threading.Thread | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def put(self, key: str, item: T, size: int) -> bool:
        """Queue one item of `size` bytes; False if it was dropped (the queue is over its bound)."""
        with self._cond:
            if self._pending and self._pending_bytes + size > self.max_pending_bytes:
                return False
            self._pending.append((key, item, size))
            self._pending_bytes += size
            self._in_flight += 1
            self._cond.notify_all()
            if self._thread is None or not self._thread.is_alive():  # first use, after `close`; a dead writer never expected
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        return True

    def close(self, timeout_s: float) -> bool:
        """Finish the items queued so far (within `timeout_s`, as `flush`) and end the writer thread;
        a later `put` starts a new one. False, with the thread left running, when a write did not
        finish: a thread stuck in a write cannot be stopped, only left behind."""
        if not self.flush(timeout_s):
            return False
        with self._cond:
            if self._in_flight:  # put meanwhile: the thread has work again
                return False
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout_s)
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait for the items queued so far; False if they did not finish within `timeout_s` or the
        writer thread is gone: never blocks forever."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    log.warning("%s: flush gave up with %d write(s) pending", self.name, self._in_flight)
                    return False
                self._cond.wait(min(left, 1.0))
        return True

    def discard(self, keys: Collection[str]) -> int:
        """Take back the queued items of these keys, and mark the one being run as cancelled if it
        is one of them; how many items that was (queued and running)."""
        with self._cond:
            kept = deque(item for item in self._pending if item[0] not in keys)
            dropped = len(self._pending) - len(kept)
            if dropped:
                self._pending = kept
                self._pending_bytes = sum(size for _, _, size in kept)
                self._in_flight -= dropped
                self._cond.notify_all()
            if self._running is not None and self._running in keys:
                self._cancelled = True
                dropped += 1
            return dropped

    def clear(self) -> None:
        """Drop every queued item (the one being run, if any, finishes)."""
        with self._cond:
            self._in_flight -= len(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            self._cond.notify_all()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._pending and self._thread is me:
                    self._cond.wait()
                if self._thread is not me:  # closed (then idle), or a later put's new thread has the queue
                    return
                key, item, size = self._pending.popleft()
                self._pending_bytes -= size
                self._running, self._cancelled = key, False
            try:
                self._run(key, item)
            except Exception:  # noqa: BLE001 - one failed item must never stop the writer
                log.exception("%s: write of %s failed", self.name, key)
            finally:
                with self._cond:
                    cancelled = self._cancelled
                    self._running, self._cancelled = None, False
                if cancelled and self._on_cancelled is not None:
                    try:  # discarded while it was being run: undo it before flush returns
                        self._on_cancelled(key)
                    except Exception:  # noqa: BLE001 - as above
                        log.exception("%s: undoing the cancelled write of %s failed", self.name, key)
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()
