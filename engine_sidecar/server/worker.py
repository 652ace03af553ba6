"""One engine worker thread with a bounded queue. The HTTP layer stays async; the engine
(which serializes requests anyway) runs here. A full queue is refused at once (429), and a
cancelled request stops between two tokens."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class QueueFull(Exception):
    pass


_DONE = object()


class EngineWorker:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragcache-engine")
        self._lock = threading.Lock()
        self.depth = 0  # queued + running

    def _admit(self) -> None:
        with self._lock:
            if self.depth >= self.max_queue:
                raise QueueFull
            self.depth += 1

    def _leave(self) -> None:
        with self._lock:
            self.depth -= 1

    async def call(self, fn: Callable[[], Any]) -> Any:
        self._admit()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self._leave()

    async def stream(self, make: Callable[[], Iterator[Any]], cancelled: threading.Event) -> AsyncIterator[Any]:
        """Run a generator on the worker, yielding its items here; `cancelled` stops it."""
        self._admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def produce() -> None:
            try:
                for item in make():
                    if cancelled.is_set():
                        break
                    loop.call_soon_threadsafe(queue.put_nowait, item)
            except BaseException as exc:  # handed to the request task, which maps it to an HTTP error
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                # the engine slot is free as soon as the engine is done, whatever the HTTP side
                # is doing (a send to a vanished client can stay pending)
                self._leave()
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        try:
            future = loop.run_in_executor(self._pool, produce)
        except RuntimeError:
            self._leave()
            raise
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
            await asyncio.shield(future)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
