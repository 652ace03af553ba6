"""Clients for a `ragcache serve` sidecar (httpx), sync and async with the same surface.

Request and response bodies are the pydantic models of `api_models`, shared with the server.
Errors come back as typed exceptions carrying the server's message and field. Only failures
where the server surely did no work are retried (a connect timeout, and 429/503 refusals,
honouring Retry-After), so a retry never runs a generation twice.

`timeout` is one deadline for a whole call: retries and their pauses, the wait for the answer
and every event of a stream. httpx's own timeouts bound each network operation only, so a
stream whose tokens keep coming would never end on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

import httpx

from ragcache_integrations.api_models import (
    TENANT_HEADER,
    CacheStats,
    ChatCompletionResponse,
    ClearResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    Usage,
    WarmRequest,
    WarmResponse,
)
from ragcache_integrations.policy_registry import DEFAULT_POLICY
from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationStats, SamplingParams

DEFAULT_URL = "http://127.0.0.1:8808"
T = TypeVar("T")


# --- errors ----------------------------------------------------------------------------------
class RagCacheAPIError(Exception):
    """The server answered with an error: `status`, `message`, `field`, `code` from its body."""

    def __init__(self, status: int, message: str, field: str | None = None, code: str | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.field, self.code = status, message, field, code


class InvalidRequestError(RagCacheAPIError):
    """4xx other than auth and rate limits: fix the request (`field` names what)."""


class AuthenticationError(RagCacheAPIError):
    """401: missing or wrong API key."""


class RateLimitError(RagCacheAPIError):
    """429: the engine queue stayed full through all retries (or none could start before the deadline)."""


class ServerError(RagCacheAPIError):
    """5xx, including 504 (the server's request timeout) and 503 (shutting down)."""


class APIConnectionError(Exception):
    """The server could not be reached (after the retries), or the connection broke."""


class APITimeoutError(APIConnectionError):
    """The call did not finish within the client's `timeout` (the server cancels the work when we hang up)."""


class _Deadline:
    """One call's time budget, started when the call starts."""

    def __init__(self, seconds: float, base_url: object):
        self.seconds, self.base_url = seconds, base_url
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; the timeout error once there are none."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.error()
        return left

    def passed(self) -> bool:
        return time.monotonic() >= self.end

    def allows(self, pause: float) -> bool:
        """Whether a retry after `pause` seconds would still start before the deadline."""
        return time.monotonic() + pause < self.end

    def error(self) -> APITimeoutError:
        return APITimeoutError(f"no complete answer from {self.base_url} within timeout={self.seconds:g} s (one "
                               "deadline for the whole call, retries and streaming included); the request was "
                               "abandoned, which cancels it on the server")


def _transport_error(exc: httpx.TransportError, deadline: _Deadline) -> APIConnectionError:
    # httpx's timeouts are set to the time left, so one firing means the deadline has come
    if isinstance(exc, httpx.TimeoutException) or deadline.passed():
        return deadline.error()
    base_url = deadline.base_url
    if isinstance(exc, httpx.ConnectError):
        return APIConnectionError(f"cannot connect to {base_url} ({exc}): is `ragcache serve` running at that "
                                  "address? It prints the address it serves on when it starts")
    return APIConnectionError(f"connection to {base_url} failed: {exc!r}")


class _Watchdog:
    """Shuts a streamed response's socket down at the deadline. A sync read blocked on a server
    that went quiet cannot be interrupted otherwise: it would wait out httpx's timeout for that
    read, which was set to the time left when the request went out."""

    def __init__(self, response: httpx.Response, deadline: _Deadline):
        self.fired = False
        self._armed = True
        self._lock = threading.Lock()
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        self._timer = threading.Timer(max(0.0, deadline.end - time.monotonic()), self._fire, (sock,))
        self._timer.daemon = True
        if sock is not None:  # without a socket (another transport) the read timeouts still apply
            self._timer.start()

    def _fire(self, sock: socket.socket) -> None:
        # under the lock: once disarmed, the connection may serve another request
        with self._lock:
            if self._armed:
                self.fired = True
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
        self._timer.cancel()


def server_root(base_url: str) -> str:
    """The sidecar's root URL. OpenAI clients are given `.../v1`; this client adds `/v1/...` itself,
    so a trailing `/v1` (an OpenAI habit) is taken off rather than ending in a bare 404."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _error_from(status: int, body: bytes, reason: str) -> RagCacheAPIError:
    try:
        err = json.loads(body).get("error", {})
        message, field, code = err.get("message") or reason, err.get("field"), err.get("code")
    except (ValueError, AttributeError):
        message, field, code = body.decode("utf-8", "replace")[:500] or reason, None, None
    if status == 404 and code is None:  # not one of the sidecar's own errors: another server answered
        message += " (is this a ragcache sidecar? `ragcache serve` prints the address to use)"
    kind = {401: AuthenticationError, 429: RateLimitError}.get(status)
    if kind is None:
        kind = ServerError if status >= 500 else InvalidRequestError
    return kind(status, message, field, code)


def _stream_error(event: dict[str, Any]) -> RagCacheAPIError:
    """An error reported inside an event stream (after the first token)."""
    err, status = event.get("error", {}), int(event.get("status", 500))
    kind = ServerError if status >= 500 else InvalidRequestError
    return kind(status, err.get("message", "stream failed"), err.get("field"), err.get("code"))


# --- request building and parsing, shared by both clients --------------------------------------
_RETRY_STATUS = (429, 503)


def _retry_delay(attempt: int, backoff_s: float, response: httpx.Response | None) -> float:
    retry_after = response.headers.get("retry-after") if response is not None else None
    if retry_after and retry_after.isdigit():
        return float(retry_after)
    return backoff_s * 2**attempt


def _pause_after_connect_timeout(exc: httpx.ConnectTimeout, attempt: int, retries: int, backoff_s: float,
                                 deadline: _Deadline) -> float:
    """The pause before trying again a connection that timed out (nothing was sent, so a retry is
    safe); raises when no retry is left or none could start before the deadline."""
    delay = _retry_delay(attempt, backoff_s, None)
    if attempt == retries or not deadline.allows(delay):
        raise _transport_error(exc, deadline) from exc
    return delay


def _pause_after_error_status(response: httpx.Response, body: bytes, attempt: int, retries: int, backoff_s: float,
                              deadline: _Deadline) -> float:
    """The pause before sending again a request the server turned away for now (429, 503, ...);
    otherwise, or with no retry left that could start in time, the server's own answer is raised."""
    if response.status_code in _RETRY_STATUS and attempt < retries:
        delay = _retry_delay(attempt, backoff_s, response)
        if deadline.allows(delay):
            return delay
    raise _error_from(response.status_code, body, response.reason_phrase)


def _generate_body(prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None, policy: str, order: str,
                   stream: bool) -> dict[str, Any]:
    request = GenerateRequest.model_validate({
        "prompt": prompt, "sampling": sampling or {}, "policy": policy, "order": order, "stream": stream,
    })
    return request.model_dump(mode="json", exclude_none=True)


def _warm_body(chunks: list[Chunk | str], system: str | None, neighbours: int | None = None) -> dict[str, Any]:
    return WarmRequest(chunks=chunks, system=system, neighbours=neighbours).model_dump(mode="json", exclude_none=True)


def _chat_body(messages: list[dict[str, Any]], chunks: list[Chunk | dict | str] | None,
               options: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, **options}
    if chunks is not None:
        body["chunks"] = [c.model_dump(mode="json") if isinstance(c, Chunk) else c for c in chunks]
    return body


def _clear_params(chunk_id: str | None, all_tenants: bool) -> dict[str, str] | None:
    params = {"chunk_id": chunk_id} if chunk_id is not None else {}
    if all_tenants:
        params["all_tenants"] = "true"
    return params or None


def _tenant(tenant: str | None) -> dict[str, str]:
    # a per-call tenant travels as the header too, replacing the client's default for that call
    return {TENANT_HEADER: tenant} if tenant else {}


def _sse_data(line: str) -> dict[str, Any] | None:
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return json.loads(data) if data and data != "[DONE]" else None


class _StreamState:
    """Turns native SSE events into deltas; keeps the final response."""

    def __init__(self) -> None:
        self.result: GenerateResponse | None = None

    def delta(self, event: dict[str, Any]) -> str | None:
        kind = event.get("type")
        if kind == "delta":
            return str(event["text"])
        if kind == "done":
            self.result = GenerateResponse.model_validate({k: v for k, v in event.items() if k != "type"})
        elif kind == "error":
            raise _stream_error(event)
        return None


_ERROR_STATUS = {"authentication_error": 401, "rate_limit_error": 429, "timeout_error": 504, "server_error": 500}


class _ChatStreamState:
    """Turns OpenAI chat chunks into deltas; assembles a GenerateResponse-shaped result (no
    token ids: the chat API does not carry them)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.finish_reason = "stop"
        self.stats = GenerationStats()
        self.usage: Usage | None = None

    def delta(self, event: dict[str, Any]) -> str | None:
        if "error" in event:
            kind = str(event["error"].get("type"))
            raise _stream_error({"status": _ERROR_STATUS.get(kind, 400), **event})
        if event.get("usage"):
            self.usage = Usage.model_validate(event["usage"])
        if event.get("ragcache"):
            self.stats = GenerationStats.model_validate(event["ragcache"])
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            content = choice.get("delta", {}).get("content")
            if content:
                self.pieces.append(content)
                return str(content)
        return None

    def result(self) -> GenerateResponse:
        usage = self.usage or Usage(prompt_tokens=self.stats.prefill_tokens_total,
                                    completion_tokens=self.stats.decode_tokens,
                                    total_tokens=self.stats.prefill_tokens_total + self.stats.decode_tokens)
        return GenerateResponse(text="".join(self.pieces), token_ids=[], finish_reason=self.finish_reason,
                                stats=self.stats, usage=usage)


def _stream_chat_body(messages: list[dict[str, Any]], chunks: list[Chunk | dict | str] | None,
                      options: dict[str, Any]) -> dict[str, Any]:
    return _chat_body(messages, chunks, {**options, "stream": True, "stream_options": {"include_usage": True}})


def _headers(api_key: str | None, tenant: str | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every request's headers: the caller's own (a gateway's, a trace id), then the key and the
    tenant, which no extra header may replace."""
    headers = dict(extra or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if tenant:
        headers[TENANT_HEADER] = tenant
    return headers


# --- sync --------------------------------------------------------------------------------------
class RagCacheClient:
    """`timeout` (seconds) bounds each call as a whole, a stream to its last event included.
    `tenant` (optional) is sent as the X-RagCache-Tenant header on every request; `headers`
    (optional) go with every request too (the key and the tenant take precedence)."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, tenant: str | None = None,
                 headers: Mapping[str, str] | None = None):
        self._http = httpx.Client(base_url=server_root(base_url), timeout=timeout,
                                  headers=_headers(api_key, tenant, headers))
        self.timeout, self.retries, self.backoff_s, self.tenant = timeout, retries, backoff_s, tenant
        self.last_result: GenerateResponse | None = None

    def _deadline(self) -> _Deadline:
        return _Deadline(self.timeout, self._http.base_url)

    def _send(self, method: str, path: str, deadline: _Deadline, stream: bool = False, **kw: Any) -> httpx.Response:
        """Send with retries within the deadline; the response is returned open (stream=True) or
        read, never an error."""
        for attempt in range(self.retries + 1):
            request = self._http.build_request(method, path, timeout=deadline.left(), **kw)
            try:
                response = self._http.send(request, stream=stream)
            except httpx.ConnectTimeout as exc:
                time.sleep(_pause_after_connect_timeout(exc, attempt, self.retries, self.backoff_s, deadline))
                continue
            except httpx.TransportError as exc:  # refused (say so now), or the work may have started: no retry
                raise _transport_error(exc, deadline) from exc
            if response.status_code < 400:
                return response
            try:
                body = response.read()
            except httpx.TransportError:
                body = b""
            response.close()
            time.sleep(_pause_after_error_status(response, body, attempt, self.retries, self.backoff_s, deadline))
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        # not streamed: the server answers all at once, so httpx's read timeout (the time left)
        # ends the wait at the deadline
        return self._send(method, path, self._deadline(), **kw).json()

    def _events(self, path: str, body: dict[str, Any], tenant: str | None,
                state: _StreamState | _ChatStreamState) -> Iterator[str]:
        """A streamed call's text deltas, until its last event or the deadline."""
        deadline = self._deadline()
        response = self._send("POST", path, deadline, stream=True, json=body, headers=_tenant(tenant))
        watchdog = _Watchdog(response, deadline)
        try:
            for line in response.iter_lines():
                deadline.left()  # tokens that keep coming do not extend the deadline
                event = _sse_data(line)
                if event is not None and (delta := state.delta(event)) is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise _transport_error(exc, deadline) from exc
        finally:
            watchdog.disarm()
            response.close()  # unread: the connection closes, which cancels the work on the server
        if watchdog.fired:  # a body without a length ends quietly when its socket is shut down
            raise deadline.error()

    def generate(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                 policy: str = DEFAULT_POLICY, order: str = "preserve", tenant: str | None = None) -> GenerateResponse:
        body = _generate_body(prompt, sampling, policy, order, False)
        self.last_result = GenerateResponse.model_validate(
            self._json("POST", "/v1/generate", json=body, headers=_tenant(tenant)))
        return self.last_result

    def stream(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
               policy: str = DEFAULT_POLICY, order: str = "preserve", tenant: str | None = None) -> Iterator[str]:
        """Yield text deltas; the full response (text, stats, usage) is `last_result` afterwards.
        Stopping early, or the deadline passing, closes the connection, which cancels the
        generation on the server."""
        body = _generate_body(prompt, sampling, policy, order, True)
        self.last_result = None
        state = _StreamState()
        yield from self._events("/v1/generate", body, tenant, state)
        self.last_result = state.result

    def chat(self, messages: list[dict[str, Any]], chunks: list[Chunk | dict | str] | None = None,
             tenant: str | None = None, **options: Any) -> ChatCompletionResponse:
        """OpenAI-style chat completion; `chunks` makes it a chunk-structured RAG prompt.
        `options`: max_tokens, temperature, top_p, stop, seed, policy, order, conversation_id, model."""
        body = _chat_body(messages, chunks, options)
        return ChatCompletionResponse.model_validate(
            self._json("POST", "/v1/chat/completions", json=body, headers=_tenant(tenant)))

    def stream_chat(self, messages: list[dict[str, Any]], chunks: list[Chunk | dict | str] | None = None,
                    tenant: str | None = None, **options: Any) -> Iterator[str]:
        """`chat`, streamed: yields text deltas; `last_result` afterwards holds the text, stats and
        usage (token_ids stay empty: the chat API does not carry them)."""
        body = _stream_chat_body(messages, chunks, options)
        self.last_result = None
        state = _ChatStreamState()
        yield from self._events("/v1/chat/completions", body, tenant, state)
        self.last_result = state.result()

    def warm(self, chunks: list[Chunk | str], system: str | None = None, tenant: str | None = None,
             neighbours: int | None = None) -> WarmResponse:
        """Precompute chunks' KV. Pass passages known together (a document's) in one call: each is
        computed after its `neighbours` most similar chunks of this call (unset: 2 when there are
        two or more, the server's default), which is closer to full prefill when they are later
        retrieved together; 0 computes each alone. The response says what it cost."""
        body = _warm_body(chunks, system, neighbours)
        return WarmResponse.model_validate(
            self._json("POST", "/v1/chunks/warm", json=body, headers=_tenant(tenant)))

    def stats(self) -> CacheStats:
        return CacheStats.model_validate(self._json("GET", "/v1/cache/stats"))

    def clear(self, chunk_id: str | None = None, tenant: str | None = None, all_tenants: bool = False) -> int:
        """Delete the tenant's entries (the default tenant without one): one chunk id's, or all of
        them; `all_tenants=True` deletes every tenant's entries."""
        params = _clear_params(chunk_id, all_tenants)
        return ClearResponse.model_validate(
            self._json("DELETE", "/v1/cache", params=params, headers=_tenant(tenant))).removed

    def health(self) -> HealthResponse:
        return HealthResponse.model_validate(self._json("GET", "/health"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RagCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- async -------------------------------------------------------------------------------------
async def _within(deadline: _Deadline, step: Callable[[], Awaitable[T]]) -> T:
    """One awaited step, cut off at the deadline (httpx cancels cleanly: the connection closes)."""
    try:
        async with asyncio.timeout(deadline.left()):
            return await step()
    except TimeoutError as exc:
        raise deadline.error() from exc


class AsyncRagCacheClient:
    """The same surface as RagCacheClient, awaitable; `stream` is an async iterator."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, tenant: str | None = None,
                 headers: Mapping[str, str] | None = None):
        self._http = httpx.AsyncClient(base_url=server_root(base_url), timeout=timeout,
                                       headers=_headers(api_key, tenant, headers))
        self.timeout, self.retries, self.backoff_s, self.tenant = timeout, retries, backoff_s, tenant
        self.last_result: GenerateResponse | None = None

    def _deadline(self) -> _Deadline:
        return _Deadline(self.timeout, self._http.base_url)

    async def _send(self, method: str, path: str, deadline: _Deadline, stream: bool = False,
                    **kw: Any) -> httpx.Response:
        """RagCacheClient._send, awaitable."""
        for attempt in range(self.retries + 1):
            request = self._http.build_request(method, path, timeout=deadline.left(), **kw)
            try:
                response = await _within(deadline, functools.partial(self._http.send, request, stream=stream))
            except httpx.ConnectTimeout as exc:
                await asyncio.sleep(_pause_after_connect_timeout(exc, attempt, self.retries, self.backoff_s, deadline))
                continue
            except httpx.TransportError as exc:  # refused (say so now), or the work may have started: no retry
                raise _transport_error(exc, deadline) from exc
            if response.status_code < 400:
                return response
            try:
                body = await response.aread()
            except httpx.TransportError:
                body = b""
            await response.aclose()
            await asyncio.sleep(_pause_after_error_status(response, body, attempt, self.retries, self.backoff_s,
                                                          deadline))
        raise AssertionError("unreachable")

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        return (await self._send(method, path, self._deadline(), **kw)).json()

    async def _events(self, path: str, body: dict[str, Any], tenant: str | None,
                      state: _StreamState | _ChatStreamState) -> AsyncGenerator[str, None]:
        """A streamed call's text deltas, until its last event or the deadline."""
        deadline = self._deadline()
        response = await self._send("POST", path, deadline, stream=True, json=body, headers=_tenant(tenant))
        lines = response.aiter_lines()
        try:
            while (line := await _within(deadline, lambda: anext(lines, None))) is not None:
                event = _sse_data(line)
                if event is not None and (delta := state.delta(event)) is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise _transport_error(exc, deadline) from exc
        finally:
            await response.aclose()  # unread: the connection closes, which cancels the work on the server

    async def generate(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                       policy: str = DEFAULT_POLICY, order: str = "preserve",
                       tenant: str | None = None) -> GenerateResponse:
        body = _generate_body(prompt, sampling, policy, order, False)
        self.last_result = GenerateResponse.model_validate(
            await self._json("POST", "/v1/generate", json=body, headers=_tenant(tenant)))
        return self.last_result

    async def stream(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                     policy: str = DEFAULT_POLICY, order: str = "preserve",
                     tenant: str | None = None) -> AsyncIterator[str]:
        body = _generate_body(prompt, sampling, policy, order, True)
        self.last_result = None
        state = _StreamState()
        # closed with this stream when the caller stops early: the connection closes at once
        async with contextlib.aclosing(self._events("/v1/generate", body, tenant, state)) as deltas:
            async for delta in deltas:
                yield delta
        self.last_result = state.result

    async def chat(self, messages: list[dict[str, Any]], chunks: list[Chunk | dict | str] | None = None,
                   tenant: str | None = None, **options: Any) -> ChatCompletionResponse:
        body = _chat_body(messages, chunks, options)
        return ChatCompletionResponse.model_validate(
            await self._json("POST", "/v1/chat/completions", json=body, headers=_tenant(tenant)))

    async def stream_chat(self, messages: list[dict[str, Any]], chunks: list[Chunk | dict | str] | None = None,
                          tenant: str | None = None, **options: Any) -> AsyncIterator[str]:
        body = _stream_chat_body(messages, chunks, options)
        self.last_result = None
        state = _ChatStreamState()
        async with contextlib.aclosing(self._events("/v1/chat/completions", body, tenant, state)) as deltas:
            async for delta in deltas:
                yield delta
        self.last_result = state.result()

    async def warm(self, chunks: list[Chunk | str], system: str | None = None,
                   tenant: str | None = None, neighbours: int | None = None) -> WarmResponse:
        body = _warm_body(chunks, system, neighbours)
        return WarmResponse.model_validate(
            await self._json("POST", "/v1/chunks/warm", json=body, headers=_tenant(tenant)))

    async def stats(self) -> CacheStats:
        return CacheStats.model_validate(await self._json("GET", "/v1/cache/stats"))

    async def clear(self, chunk_id: str | None = None, tenant: str | None = None, all_tenants: bool = False) -> int:
        params = _clear_params(chunk_id, all_tenants)
        return ClearResponse.model_validate(
            await self._json("DELETE", "/v1/cache", params=params, headers=_tenant(tenant))).removed

    async def health(self) -> HealthResponse:
        return HealthResponse.model_validate(await self._json("GET", "/health"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRagCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["APIConnectionError", "APITimeoutError", "AsyncRagCacheClient", "AuthenticationError", "InvalidRequestError",
           "RagCacheAPIError", "RagCacheClient", "RateLimitError", "ServerError"]
