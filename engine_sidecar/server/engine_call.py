"""Engine work as a request handler sees it: queued on the engine worker, watched for a client
disconnect and the request deadline, consumed as the items the work yields (for a generation:
text deltas, then the GenerationResult).

Errors raised before the first item (bad prompt, prompt over the context window, full queue)
surface from `start()`, so they become ordinary 4xx responses even for streaming requests;
later failures end the stream and the caller reports them in the stream itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

from fastapi import Request

from engine_sidecar.server.backend import Event
from engine_sidecar.server.context import ServerContext
from engine_sidecar.server.errors import ApiError
from engine_sidecar.server.tenancy import unscope_result
from engine_sidecar.server.worker import Job, QueueFull, WorkerStopped
from ragcache_integrations.types import GenerationResult

Outcome = Literal["running", "completed", "disconnected", "timeout", "error"]
_NOTHING = object()  # the work finished without yielding anything


class EngineCall:
    def __init__(self, ctx: ServerContext, request: Request, endpoint: str, make: Callable[[], Iterator[Event]],
                 tenant: str = "", generation: bool = True):
        self.ctx, self.request, self.endpoint, self.make, self.tenant = ctx, request, endpoint, make, tenant
        self.generation = generation  # observed for TTFT
        self.arrived = time.monotonic()
        self.deadline = self.arrived + ctx.settings.request_timeout_s
        self.outcome: Outcome = "running"
        self.result: GenerationResult | None = None
        self._job: Job | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._first: Event = _NOTHING
        self._closed = False

    async def start(self) -> None:
        """Queue the work and wait for its first event; raise the HTTP error if there is none."""
        try:
            self._job = self.ctx.worker.submit(self.make)
        except QueueFull:
            self.ctx.metrics.job(self.endpoint, "rejected", None)
            raise ApiError(429, f"the engine queue is full ({self.ctx.settings.max_queue} requests queued or "
                                "running); retry after the Retry-After seconds", None, "queue_full",
                           {"Retry-After": str(self.ctx.settings.retry_after_s)}) from None
        except WorkerStopped:
            raise ApiError(503, "the server is shutting down", None, "shutting_down") from None
        self._watcher = asyncio.create_task(self._watch())
        try:
            self._first = await self._job.next()
        except StopAsyncIteration:
            if self.outcome == "running":  # finished without yielding anything
                self.outcome = "completed"
                return
            await self.close()
            if self.outcome == "timeout":
                what = "produce its first token" if self.generation else "finish"
                raise ApiError(504, f"the request did not {what} within {self.ctx.settings.request_timeout_s:g} s "
                                    "(--request-timeout)", None, "timeout") from None
            raise ApiError(503, "the request was cancelled before it started", None, "cancelled") from None
        except BaseException:
            self.outcome = "error"
            await self.close()
            raise
        if self.generation:
            self.ctx.metrics.first_token(time.monotonic() - self.arrived)

    async def events(self) -> AsyncIterator[Event]:
        """The work's items (deltas, then the result); ends early on disconnect or timeout."""
        assert self._job is not None, "call start() first"
        try:
            item: Event = self._first
            while item is not _NOTHING:
                if isinstance(item, GenerationResult):
                    self.result = unscope_result(item, self.tenant)
                    self.outcome = "completed"
                    yield self.result
                elif item != "":
                    yield item
                item = await self._job.next()
        except StopAsyncIteration:
            if self.outcome == "running":
                self.outcome = "completed"
        except BaseException:
            if self.outcome == "running":
                self.outcome = "error"
            raise
        finally:
            await self.close()

    async def collect(self) -> list[Event]:
        """All items; a timeout is a 504 (a client that left gets nothing either way)."""
        items = [item async for item in self.events()]
        if self.outcome == "timeout":
            raise ApiError(504, f"the request did not finish within {self.ctx.settings.request_timeout_s:g} s "
                                "(--request-timeout)", None, "timeout")
        if self.outcome != "completed":
            raise ApiError(503, "the request was cancelled", None, "cancelled")
        return items

    async def result_of(self) -> GenerationResult:
        await self.collect()
        assert self.result is not None
        return self.result

    async def close(self) -> None:
        """Idempotent: stop the engine at its next token (if still running), stop watching."""
        if self._closed:
            return
        self._closed = True
        if self._job is not None and not self._job.finished:
            self._job.cancel()
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        if self.outcome == "running":  # the caller stopped consuming: its client went away
            self.outcome = "disconnected"
        self.ctx.metrics.job(self.endpoint, self.outcome, self.result, time.monotonic() - self.arrived)

    async def _watch(self) -> None:
        """Cancel the job when the client disconnects or the deadline passes. Starlette notices
        a disconnect only while it is writing a streamed body; this also covers the queue wait,
        the prefill and non-streaming requests."""
        assert self._job is not None
        try:
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                while (await self.request.receive())["type"] != "http.disconnect":
                    pass
            reason: Outcome = "disconnected"
        except TimeoutError:
            reason = "timeout"
        if self.outcome == "running":  # a finished request keeps its outcome
            self.outcome = reason
            self._job.cancel()


async def run_on_worker(ctx: ServerContext, request: Request, endpoint: str, fn: Callable[[], Any]) -> Any:
    """One blocking engine call (warm, clear) with the same queue, timeout and disconnect rules."""
    call = EngineCall(ctx, request, endpoint, lambda: (fn() for _ in range(1)), generation=False)
    await call.start()
    return (await call.collect())[0]
