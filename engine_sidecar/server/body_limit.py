"""Refuse oversize bodies before they are read into memory and parsed (pure ASGI middleware)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_sidecar.server.errors import error_body

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(StarletteHTTPException):
    field = "body"
    code = "body_too_large"

    def __init__(self, size: int, limit: int):
        super().__init__(413, f"body has at least {size} bytes; the limit is {limit}")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            body = json.dumps(error_body(413, str(BodyTooLarge(int(declared), self.max_bytes).detail), "body",
                                         "body_too_large")).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def limited_receive() -> Message:
            # a chunked body has no Content-Length: count as it arrives. FastAPI re-raises an
            # HTTPException from the body read, so this ends as a normal 413 error response.
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(seen, self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
