"""Clients for a `ragcache serve` sidecar (httpx), sync and async with the same surface.

Request and response bodies are the pydantic models of `api_models`, shared with the server.
Errors come back as typed exceptions carrying the server's message and field. Only failures
where the server surely did no work are retried (connection refused or reset before the request
was sent, and 429/503 refusals, honouring Retry-After), so a retry never runs a generation twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

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
    """429: the engine queue stayed full through all retries."""


class ServerError(RagCacheAPIError):
    """5xx, including 504 (the server's request timeout) and 503 (shutting down)."""


class APIConnectionError(Exception):
    """The server could not be reached (after the retries), or the connection broke."""


class APITimeoutError(APIConnectionError):
    """No answer within the client's `timeout` (the server cancels the work when we hang up)."""


def _transport_error(exc: httpx.TransportError, base_url: object) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"no answer from {base_url} in time: {exc!r}")
    if isinstance(exc, httpx.ConnectError):
        return APIConnectionError(f"cannot connect to {base_url} ({exc}): is `ragcache serve` running at that "
                                  "address? It prints the address it serves on when it starts")
    return APIConnectionError(f"connection to {base_url} failed: {exc!r}")


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
    """`tenant` (optional) is sent as the X-RagCache-Tenant header on every request; `headers`
    (optional) go with every request too (the key and the tenant take precedence)."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, tenant: str | None = None,
                 headers: Mapping[str, str] | None = None):
        self._http = httpx.Client(base_url=server_root(base_url), timeout=timeout,
                                  headers=_headers(api_key, tenant, headers))
        self.retries, self.backoff_s, self.tenant = retries, backoff_s, tenant
        self.last_result: GenerateResponse | None = None

    def _send(self, method: str, path: str, stream: bool = False, **kw: Any) -> httpx.Response:
        """Send with retries; the response is returned open (stream=True) or read, never an error."""
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = self._http.send(self._http.build_request(method, path, **kw), stream=stream)
            except httpx.ConnectError as exc:  # nothing listens there (refused, unknown host): say so now
                raise _transport_error(exc, self._http.base_url) from exc
            except httpx.ConnectTimeout as exc:  # nothing was sent: safe to retry
                if last:
                    raise _transport_error(exc, self._http.base_url) from exc
                time.sleep(_retry_delay(attempt, self.backoff_s, None))
                continue
            except httpx.TransportError as exc:  # the server may have started the work: no retry
                raise _transport_error(exc, self._http.base_url) from exc
            if response.status_code < 400:
                return response
            try:
                body = response.read()
            except httpx.TransportError:
                body = b""
            response.close()
            if response.status_code in _RETRY_STATUS and not last:
                time.sleep(_retry_delay(attempt, self.backoff_s, response))
                continue
            raise _error_from(response.status_code, body, response.reason_phrase)
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return self._send(method, path, **kw).json()

    def generate(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                 policy: str = DEFAULT_POLICY, order: str = "preserve", tenant: str | None = None) -> GenerateResponse:
        body = _generate_body(prompt, sampling, policy, order, False)
        self.last_result = GenerateResponse.model_validate(
            self._json("POST", "/v1/generate", json=body, headers=_tenant(tenant)))
        return self.last_result

    def stream(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
               policy: str = DEFAULT_POLICY, order: str = "preserve", tenant: str | None = None) -> Iterator[str]:
        """Yield text deltas; the full response (text, stats, usage) is `last_result` afterwards.
        Stopping early closes the connection, which cancels the generation on the server."""
        body = _generate_body(prompt, sampling, policy, order, True)
        self.last_result = None
        state = _StreamState()
        response = self._send("POST", "/v1/generate", stream=True, json=body, headers=_tenant(tenant))
        try:
            for line in response.iter_lines():
                event = _sse_data(line)
                if event is not None and (delta := state.delta(event)) is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise _transport_error(exc, self._http.base_url) from exc
        finally:
            response.close()
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
        response = self._send("POST", "/v1/chat/completions", stream=True, json=body, headers=_tenant(tenant))
        try:
            for line in response.iter_lines():
                event = _sse_data(line)
                if event is not None and (delta := state.delta(event)) is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise _transport_error(exc, self._http.base_url) from exc
        finally:
            response.close()
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
class AsyncRagCacheClient:
    """The same surface as RagCacheClient, awaitable; `stream` is an async iterator."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, tenant: str | None = None,
                 headers: Mapping[str, str] | None = None):
        self._http = httpx.AsyncClient(base_url=server_root(base_url), timeout=timeout,
                                       headers=_headers(api_key, tenant, headers))
        self.retries, self.backoff_s, self.tenant = retries, backoff_s, tenant
        self.last_result: GenerateResponse | None = None

    async def _send(self, method: str, path: str, stream: bool = False, **kw: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = await self._http.send(self._http.build_request(method, path, **kw), stream=stream)
            except httpx.ConnectError as exc:  # nothing listens there (refused, unknown host): say so now
                raise _transport_error(exc, self._http.base_url) from exc
            except httpx.ConnectTimeout as exc:  # nothing was sent: safe to retry
                if last:
                    raise _transport_error(exc, self._http.base_url) from exc
                await asyncio.sleep(_retry_delay(attempt, self.backoff_s, None))
                continue
            except httpx.TransportError as exc:  # the server may have started the work: no retry
                raise _transport_error(exc, self._http.base_url) from exc
            if response.status_code < 400:
                return response
            try:
                body = await response.aread()
            except httpx.TransportError:
                body = b""
            await response.aclose()
            if response.status_code in _RETRY_STATUS and not last:
                await asyncio.sleep(_retry_delay(attempt, self.backoff_s, response))
                continue
            raise _error_from(response.status_code, body, response.reason_phrase)
        raise AssertionError("unreachable")

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        return (await self._send(method, path, **kw)).json()

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
        response = await self._send("POST", "/v1/generate", stream=True, json=body, headers=_tenant(tenant))
        try:
            async for line in response.aiter_lines():
                event = _sse_data(line)
                if event is not None and (delta := state.delta(event)) is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise _transport_error(exc, self._http.base_url) from exc
        finally:
            await response.aclose()
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
        response = await self._send("POST", "/v1/chat/completions", stream=True, json=body,
                                    headers=_tenant(tenant))
        try:
            async for line in response.aiter_lines():
                event = _sse_data(line)
                if event is not None and (delta := state.delta(event)) is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise _transport_error(exc, self._http.base_url) from exc
        finally:
            await response.aclose()
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
