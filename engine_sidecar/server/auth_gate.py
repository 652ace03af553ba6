"""The API key checked from the headers alone, before any route runs or any body byte is read
(pure ASGI middleware): a client without the key cannot make the server read, parse or validate
anything. Only the probes an operator's tooling calls without credentials stay open."""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING

from engine_sidecar.server.errors import error_body

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

# liveness and Prometheus scrapes; everything else, the schema pages included, needs the key
OPEN_PATHS = frozenset({"/health", "/metrics"})
MISSING_KEY = "missing or wrong API key: send 'Authorization: Bearer <key>'"


class ApiKeyGate:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        sent = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                sent = value
                break
        scheme, _, token = sent.partition(b" ")
        # the scheme is case-insensitive (RFC 7235); the key is compared in constant time
        if scheme.lower() == b"bearer" and secrets.compare_digest(b"Bearer " + token.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, MISSING_KEY, "authorization", "invalid_api_key")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"www-authenticate", b"Bearer")]
        if _has_body(scope):  # else the server reads and discards the body to keep the connection
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _has_body(scope: Scope) -> bool:
    headers = dict(scope.get("headers", []))
    length = headers.get(b"content-length")
    return (length is not None and length.strip() not in (b"", b"0")) or b"chunked" in headers.get(
        b"transfer-encoding", b"").lower()
