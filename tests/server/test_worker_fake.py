"""The server's engine worker with no model behind it: jobs written here (plain iterators) run on
the real EngineWorker, through the real EngineCall and, for the HTTP mapping, through the real
app over a fake backend that answers from a script.

Nothing here waits on a clock: a job that must stay in progress blocks on an Event the test
sets, and every blocking wait has a generous timeout, so a worker that never answers fails the
test instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine_sidecar.errors import InvalidPromptError, NonFiniteLogitsError, PromptTooLongError
from engine_sidecar.server import ServerSettings, create_app
from engine_sidecar.server.backend import EngineFacts, Event
from engine_sidecar.server.context import ServerContext
from engine_sidecar.server.engine_call import EngineCall
from engine_sidecar.server.errors import ApiError
from engine_sidecar.server.metrics import ServerMetrics
from engine_sidecar.server.worker import EngineWorker, QueueFull, WorkerStopped
from ragcache_integrations.types import ChunkedPrompt, GenerationResult, GenerationStats, SamplingParams

WAIT_S = 60.0  # generous: only a broken worker gets anywhere near it


def answer(text: str, policy: str = "full") -> GenerationResult:
    return GenerationResult(text=text, token_ids=list(range(len(text.split()))), finish_reason="stop",
                            stats=GenerationStats(policy=policy, prefill_tokens_total=5))


class Blocked:
    """A job that yields "first", then waits for `go` before each further item (`waiting` says
    it does: the worker is inside the job, past its check of the first item); `closed` says the
    worker closed it, `produced` what it yielded."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.waiting = threading.Event()
        self.closed = threading.Event()
        self.produced: list[str] = []

    def __call__(self) -> Iterator[str]:
        try:
            for item in ("first", "second", "third"):
                if item != "first":
                    self.waiting.set()
                    if not self.go.wait(WAIT_S):
                        raise AssertionError("the test never let the job go on")
                self.produced.append(item)
                yield item
        finally:
            self.closed.set()


async def waited(event: threading.Event) -> bool:
    """A thread's Event, waited for off the event loop (which must keep running for the worker
    to post items)."""
    return await asyncio.to_thread(event.wait, WAIT_S)


async def drain(job: Any) -> list[Any]:
    return [item async for item in job]


# --- the worker alone ----------------------------------------------------------------------------

def test_a_job_yields_its_items_in_order_then_frees_its_slot():
    async def run() -> None:
        worker = EngineWorker(max_queue=2)
        job = worker.submit(lambda: iter(["a", "b", "c"]))
        assert await drain(job) == ["a", "b", "c"]
        assert worker.depth == 0  # the slot frees before the job's end reaches the loop
        worker.shutdown()

    asyncio.run(run())


def test_errors_reach_the_caller_before_or_after_the_first_item():
    def fails_at_once() -> Iterator[str]:
        raise InvalidPromptError("the question is empty")
        yield "never"

    def fails_midway() -> Iterator[str]:
        yield "partial"
        raise NonFiniteLogitsError("NaN")

    async def run() -> None:
        worker = EngineWorker(max_queue=2)
        with pytest.raises(InvalidPromptError, match="the question is empty"):
            await worker.submit(fails_at_once).next()
        job = worker.submit(fails_midway)
        assert await job.next() == "partial"
        with pytest.raises(NonFiniteLogitsError):
            await job.next()
        with pytest.raises(StopAsyncIteration):  # a failed job stays finished
            await job.next()
        assert worker.depth == 0
        assert await worker.call(lambda: 42) == 42
        with pytest.raises(ZeroDivisionError):
            await worker.call(lambda: 1 // 0)
        worker.shutdown()

    asyncio.run(run())


def test_admission_is_refused_past_max_queue_until_a_slot_frees():
    async def run() -> None:
        worker = EngineWorker(max_queue=1)
        blocked = Blocked()
        job = worker.submit(blocked)
        assert await job.next() == "first"
        with pytest.raises(QueueFull):
            worker.submit(lambda: iter(["x"]))
        assert worker.depth == 1
        blocked.go.set()
        assert await drain(job) == ["second", "third"]
        assert await drain(worker.submit(lambda: iter(["x"]))) == ["x"]
        worker.shutdown()

    asyncio.run(run())


def test_a_cancelled_job_stops_at_its_next_item_and_is_closed():
    async def run() -> None:
        worker = EngineWorker(max_queue=2)
        blocked = Blocked()
        job = worker.submit(blocked)
        assert await job.next() == "first"
        assert await waited(blocked.waiting)
        job.cancel()
        with pytest.raises(StopAsyncIteration):  # the waiting side returns at once
            await job.next()
        blocked.go.set()
        assert await waited(blocked.closed)
        await asyncio.to_thread(worker.shutdown)  # joins the job's thread
        assert blocked.produced == ["first", "second"]  # stopped after the item it was making
        assert worker.depth == 0

    asyncio.run(run())


def test_shutdown_refuses_new_jobs_and_stops_running_ones():
    async def run() -> None:
        worker = EngineWorker(max_queue=2)
        blocked = Blocked()
        job = worker.submit(blocked)
        assert await job.next() == "first"
        assert await waited(blocked.waiting)
        stopping = asyncio.ensure_future(asyncio.to_thread(worker.shutdown))
        with pytest.raises(StopAsyncIteration):  # shutdown ends every live job's wait
            await job.next()
        with pytest.raises(WorkerStopped):
            worker.submit(lambda: iter(["x"]))
        blocked.go.set()  # the job sees the shutdown at its next item
        await asyncio.wait_for(stopping, WAIT_S)
        assert blocked.closed.is_set() and blocked.produced == ["first", "second"]

    asyncio.run(run())


# --- EngineCall: what a route sees -----------------------------------------------------------------

class FakeRequest:
    """Starlette's request as EngineCall uses it: `receive()` gives http.disconnect once `leaves`
    is set (the client went away); without one it waits for good (a client still there sends
    nothing more)."""

    def __init__(self, leaves: threading.Event | None = None):
        self.leaves = leaves

    async def receive(self) -> dict[str, str]:
        if self.leaves is None:
            await asyncio.Event().wait()
        elif await waited(self.leaves):
            return {"type": "http.disconnect"}
        raise AssertionError("the client never left")


class FakeBackend:
    """A ServingBackend answering `/v1/generate` from `script` (question -> job) with no engine."""

    name = "ragcache"

    def __init__(self, script: dict[str, Callable[[SamplingParams, str], Iterator[Event]]] | None = None):
        self.script = script or {}
        self.failure: str | None = None

    def store_facts(self) -> None:
        return None

    def store_stats(self) -> None:
        return None

    def kv_rows(self) -> None:
        return None

    def facts(self) -> EngineFacts:
        if self.failure is not None:
            raise ApiError(503, f"the engine's scheduler stopped on a fault ({self.failure}); restart the server",
                           None, "engine_failed")
        return EngineFacts("fake", "/models/fake", 2048, "cpu", "float32")

    def check_policy(self, policy: str) -> None:
        return None

    def generate(self, prompt: ChunkedPrompt, sampling: SamplingParams, policy: str, tenant: str,
                 order: str) -> Iterator[Event]:
        return self.script[prompt.question](sampling, policy)

    def close(self) -> None:
        return None


def context(max_queue: int = 1) -> ServerContext:
    worker = EngineWorker(max_queue)
    backend = FakeBackend()
    return ServerContext(backend, worker, ServerMetrics(None, worker), ServerSettings(max_queue=max_queue))  # type: ignore[arg-type]


def test_a_full_queue_is_a_429_with_retry_after_and_a_stopped_worker_a_503():
    async def run() -> None:
        ctx = context(max_queue=1)
        blocked = Blocked()
        first = EngineCall(ctx, FakeRequest(), "generate", blocked)  # type: ignore[arg-type]
        await first.start()
        with pytest.raises(ApiError) as refused:
            await EngineCall(ctx, FakeRequest(), "generate", lambda: iter(["x"])).start()  # type: ignore[arg-type]
        assert (refused.value.status, refused.value.code) == (429, "queue_full")
        assert refused.value.headers == {"Retry-After": str(ctx.settings.retry_after_s)}
        blocked.go.set()
        assert [item async for item in first.events()] == ["first", "second", "third"]
        assert first.outcome == "completed"
        await asyncio.to_thread(ctx.worker.shutdown)
        with pytest.raises(ApiError) as stopped:
            await EngineCall(ctx, FakeRequest(), "generate", lambda: iter(["x"])).start()  # type: ignore[arg-type]
        assert (stopped.value.status, stopped.value.code) == (503, "shutting_down")

    asyncio.run(run())


def test_a_client_gone_before_the_first_item_is_a_503_and_its_job_stops():
    async def run() -> None:
        ctx = context(max_queue=2)
        blocked = Blocked()

        running = threading.Event()

        def slow_start() -> Iterator[str]:
            running.set()  # the client leaves now, while the job makes its first item
            if not blocked.go.wait(WAIT_S):
                raise AssertionError("the test never let the job go on")
            yield from blocked()

        call = EngineCall(ctx, FakeRequest(leaves=running), "generate", slow_start)  # type: ignore[arg-type]
        with pytest.raises(ApiError) as cancelled:
            await call.start()
        assert (cancelled.value.status, cancelled.value.code) == (503, "cancelled")
        assert call.outcome == "disconnected"
        blocked.go.set()
        await asyncio.to_thread(ctx.worker.shutdown)
        assert blocked.produced == ["first"]  # stopped at its first item: nobody was reading
        assert ctx.worker.depth == 0

    asyncio.run(run())


# --- the app over a fake backend: HTTP as clients see it -------------------------------------------

def _fine(sampling: SamplingParams, policy: str) -> Iterator[Event]:
    yield "It "
    yield ""  # a token that added no text yet: dropped, never sent
    yield "is."
    yield answer("It is.", policy)


def _too_long(sampling: SamplingParams, policy: str) -> Iterator[Event]:
    raise PromptTooLongError("the prompt is 9000 tokens; the context window is 2048")
    yield ""


def _breaks_midway(sampling: SamplingParams, policy: str) -> Iterator[Event]:
    yield "Half"
    raise NonFiniteLogitsError("the model produced non-finite numbers")


def _bug(sampling: SamplingParams, policy: str) -> Iterator[Event]:
    raise RuntimeError("secret internals")
    yield ""


SCRIPT = {"Why?": _fine, "Too long?": _too_long, "Midway?": _breaks_midway, "Bug?": _bug}


@pytest.fixture
def app_client() -> Iterator[tuple[TestClient, FakeBackend]]:
    backend = FakeBackend(SCRIPT)
    with TestClient(create_app(backend, ServerSettings()), raise_server_exceptions=False) as client:  # type: ignore[arg-type]
        yield client, backend


def _generate(client: TestClient, question: str, stream: bool = False) -> Any:
    return client.post("/v1/generate", json={"prompt": {"chunks": ["A passage."], "question": question},
                                             "sampling": {"max_tokens": 4}, "stream": stream})


def _events(body: str) -> list[tuple[str | None, dict]]:
    out = []
    for block in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def test_a_generation_returns_the_jobs_result(app_client):
    client, _ = app_client
    reply = _generate(client, "Why?")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["text"] == "It is." and body["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    streamed = _events(_generate(client, "Why?", stream=True).text)
    assert [e for e, _ in streamed] == [None, None, "done"]
    assert [d.get("text") for _, d in streamed[:2]] == ["It ", "is."]
    assert streamed[-1][1]["text"] == "It is."
    metrics = client.get("/metrics").text
    assert 'ragcache_engine_jobs_total{endpoint="generate",outcome="completed"} 2.0' in metrics


def test_engine_errors_before_the_first_item_are_their_http_status(app_client):
    client, _ = app_client
    for stream in (False, True):  # even a streamed request: nothing was sent yet
        reply = _generate(client, "Too long?", stream)
        assert reply.status_code == 413
        assert reply.json()["error"]["code"] == "PromptTooLongError"
        assert "context window" in reply.json()["error"]["message"]
    bug = _generate(client, "Bug?")
    assert bug.status_code == 500 and bug.json()["error"]["code"] == "internal_error"
    assert "secret" not in bug.text  # a bug's details stay in the server log
    assert 'ragcache_engine_jobs_total{endpoint="generate",outcome="error"} 3.0' in client.get("/metrics").text


def test_an_error_after_the_first_item_ends_the_stream_with_an_error_event(app_client):
    client, _ = app_client
    streamed = _generate(client, "Midway?", stream=True)
    assert streamed.status_code == 200
    events = _events(streamed.text)
    assert events[0] == (None, {"type": "delta", "text": "Half"})
    kind, data = events[-1]
    assert kind == "error" and data["status"] == 422 and "non-finite" in data["error"]["message"]
    whole = _generate(client, "Midway?")  # not streamed: the error is the response
    assert whole.status_code == 422 and whole.json()["error"]["code"] == "NonFiniteLogitsError"


def test_health_reports_the_backend_and_a_stopped_engine_is_a_503(app_client):
    client, backend = app_client
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["model"] == "fake"
    backend.failure = "RuntimeError: pool broken"
    down = client.get("/health")
    assert down.status_code == 503 and down.json()["error"]["code"] == "engine_failed"
