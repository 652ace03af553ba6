"""One HTTP request, carried as plain data, run through an ASGI app in-process, its response
streamed back as plain data: how an engine replica serves the very FastAPI app `ragcache serve`
runs (routes, validation, auth, tenancy, SSE, errors, metrics), behind Ray Serve's proxy.

The request travels as a dict (method, path, query, headers, body) so the router can read the
chunk summary beside it; the response comes back as one `start` message (status and headers),
then body pieces as they are produced, so streaming still streams. No Ray import here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

Message = dict[str, Any]


def request_payload(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes, route: dict[str, Any] | None) -> dict[str, Any]:
    return {"method": method, "path": path, "query": query, "headers": headers, "body": body, "route": route}


async def run_asgi(app: Any, payload: dict[str, Any]) -> AsyncIterator[Message | bytes]:
    """Yields {"status", "headers"} once, then the body as bytes pieces. Closing the iterator early
    (the client left, Ray cancelled the call) tells the app its client disconnected, which stops
    the engine at its next token."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": payload["method"], "scheme": "http", "path": payload["path"], "raw_path": payload["path"].encode(),
             "root_path": "", "query_string": payload["query"], "headers": payload["headers"],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    disconnected = asyncio.Event()
    body_sent = False
    out: asyncio.Queue[Message | None] = asyncio.Queue()

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload["body"], "more_body": False}
        await disconnected.wait()  # the app polls for a disconnect while it works
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    started = False
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                started = True
                yield {"status": message["status"], "headers": [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        disconnected.set()
        # the app winds down (its disconnect watchers return) within moments; never wait forever
        done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:
            task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await task
    if task.done() and not task.cancelled() and task.exception() is not None and not started:
        raise task.exception()  # type: ignore[misc]
