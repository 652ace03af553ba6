"""Engine jobs off the event loop, behind a bounded admission count.

Admission is refused at once when `max_queue` requests are queued or running (the HTTP layer
answers 429). Each admitted job gets a thread of its own: a generation job mostly waits on its
sequence's outbox while the engine's scheduler batches it with the others; warm-ups and clears
take the engine's lock between scheduler steps. A job is an iterator; its items reach the event
loop through an asyncio queue, and a cancelled job stops between two items (two tokens), or is
skipped altogether if it was cancelled before it started.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class QueueFull(Exception):
    pass


class WorkerStopped(Exception):
    pass


_END = object()  # the job's iterator is exhausted
_CANCELLED = object()  # the HTTP side gave up: stop waiting for the worker


class Job:
    """Loop-side handle of one submitted job: `await job.next()` until it raises StopAsyncIteration."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()  # read by the worker thread between items
        self.finished = False

    def post(self, item: Any) -> None:
        """Called from the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop is gone (process shutting down): nobody is listening
            pass

    def cancel(self) -> None:
        """Called on the loop: the worker stops at its next item; a waiting `next()` returns now."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            self._items.put_nowait(_CANCELLED)

    async def next(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        item = await self._items.get()
        if item is _END or item is _CANCELLED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def __aiter__(self) -> Job:
        return self

    async def __anext__(self) -> Any:
        return await self.next()


class EngineWorker:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_queue), thread_name_prefix="ragcache-job")
        self._lock = threading.Lock()
        self._depth = 0
        self._live: set[Job] = set()
        self._stopping = threading.Event()

    @property
    def depth(self) -> int:
        """Jobs queued or running."""
        return self._depth

    def submit(self, make: Callable[[], Iterator[Any]]) -> Job:
        """Admit a job (or raise QueueFull / WorkerStopped) and queue it on the worker thread."""
        job = Job(asyncio.get_running_loop())
        with self._lock:
            if self._stopping.is_set():
                raise WorkerStopped
            if self._depth >= self.max_queue:
                raise QueueFull
            self._depth += 1
            self._live.add(job)
        try:
            self._pool.submit(self._run, make, job)
        except RuntimeError:  # pool already shut down
            self._release(job)
            raise WorkerStopped from None
        return job

    def _release(self, job: Job) -> None:
        with self._lock:
            self._depth -= 1
            self._live.discard(job)

    def _run(self, make: Callable[[], Iterator[Any]], job: Job) -> None:
        items: Iterator[Any] | None = None
        try:
            if job.cancelled.is_set() or self._stopping.is_set():
                return  # its client left (or the server is stopping) while it waited: skip the work
            items = make()
            for item in items:
                job.post(item)
                if job.cancelled.is_set() or self._stopping.is_set():
                    break
        except BaseException as exc:  # handed to the request, which maps it to an HTTP error
            job.post(exc)
        finally:
            # close explicitly: the engine's generator holds its lock until it is closed
            close = getattr(items, "close", None)
            if close is not None:
                close()
            # the slot frees as soon as the engine is done, whatever the HTTP side is doing
            self._release(job)
            job.post(_END)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run one function on the worker (admission rules apply) and return its result."""
        job = self.submit(lambda: iter((fn(),)))
        try:
            return await job.next()
        finally:
            job.cancel()

    def shutdown(self) -> None:
        """Stop taking jobs, stop running ones at their next item, and wait for the thread."""
        with self._lock:
            self._stopping.set()
            live = list(self._live)
        for job in live:
            job.cancelled.set()
            job.post(_CANCELLED)  # jobs the pool drops unrun would otherwise be awaited forever
        self._pool.shutdown(wait=True, cancel_futures=True)
