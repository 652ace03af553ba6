"""Clients for the ragcache sidecar (httpx). Errors come back as typed exceptions carrying the
server's message; connection failures are retried with exponential backoff."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from ragcache_integrations.api_models import (
    CacheStats,
    GenerateRequest,
    GenerateResponse,
    WarmRequest,
    WarmResponse,
)
from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationResult, SamplingParams


class RagCacheError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.field = status, message, field


class InvalidRequestError(RagCacheError):
    pass


class AuthenticationError(RagCacheError):
    pass


class RateLimitError(RagCacheError):
    pass


class ServerError(RagCacheError):
    pass


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.read() if not response.is_stream_consumed else response.content)
        err = body.get("error", {})
        message, field = err.get("message", str(body)), err.get("field")
    except (json.JSONDecodeError, AttributeError, httpx.ResponseNotRead):
        message, field = response.reason_phrase, None
    kind = {401: AuthenticationError, 429: RateLimitError}.get(response.status_code)
    if kind is None:
        kind = ServerError if response.status_code >= 500 else InvalidRequestError
    raise kind(response.status_code, message, field)


def _body(prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None, policy: str, order: str,
          tenant: str | None, stream: bool) -> dict[str, Any]:
    request = GenerateRequest(prompt=prompt if isinstance(prompt, ChunkedPrompt) else ChunkedPrompt(**prompt),
                              sampling=sampling if isinstance(sampling, SamplingParams)
                              else SamplingParams(**(sampling or {})),
                              policy=policy, order=order, tenant=tenant, stream=stream)
    return request.model_dump(mode="json", exclude_none=True)


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


class RagCacheClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8808", api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, tenant: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=headers)
        self.retries, self.backoff_s, self.tenant = retries, backoff_s, tenant
        self.last_result: GenerationResult | None = None

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                response = self._http.request(method, path, **kw)
                _raise_for(response)
                return response
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                if attempt == self.retries:
                    raise
                time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def generate(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                 policy: str = "cacheblend", order: str = "preserve", tenant: str | None = None) -> GenerateResponse:
        body = _body(prompt, sampling, policy, order, tenant or self.tenant, False)
        result = GenerateResponse.model_validate(self._request("POST", "/v1/generate", json=body).json())
        self.last_result = result
        return result

    def stream(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
               policy: str = "cacheblend", order: str = "preserve", tenant: str | None = None) -> Iterator[str]:
        """Yield text deltas; the full result (with stats) is `self.last_result` afterwards."""
        body = _body(prompt, sampling, policy, order, tenant or self.tenant, True)
        with self._http.stream("POST", "/v1/generate", json=body) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for(response)
            for event in _sse_events(response.iter_lines()):
                if event.get("type") == "delta":
                    yield event["text"]
                elif event.get("type") == "done":
                    event.pop("type")
                    self.last_result = GenerateResponse.model_validate(event)

    def chat(self, messages: list[dict[str, str]], chunks: list[Chunk | dict | str] | None = None,
             **options: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": messages, **options}
        if chunks is not None:
            body["chunks"] = [c.model_dump() if isinstance(c, Chunk) else ({"text": c} if isinstance(c, str) else c)
                              for c in chunks]
        return self._request("POST", "/v1/chat/completions", json=body).json()

    def warm(self, chunks: list[Chunk | str], system: str | None = None, tenant: str | None = None) -> WarmResponse:
        body = WarmRequest(chunks=[Chunk(text=c) if isinstance(c, str) else c for c in chunks], system=system,
                           tenant=tenant or self.tenant).model_dump(mode="json", exclude_none=True)
        return WarmResponse.model_validate(self._request("POST", "/v1/chunks/warm", json=body).json())

    def stats(self) -> CacheStats:
        return CacheStats.model_validate(self._request("GET", "/v1/cache/stats").json())

    def clear(self, chunk_id: str | None = None) -> int:
        params = {"chunk_id": chunk_id} if chunk_id else None
        return int(self._request("DELETE", "/v1/cache", params=params).json()["removed"])

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health").json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RagCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRagCacheClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8808", api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, tenant: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=headers)
        self.retries, self.backoff_s, self.tenant = retries, backoff_s, tenant
        self.last_result: GenerationResult | None = None

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                response = await self._http.request(method, path, **kw)
                _raise_for(response)
                return response
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                if attempt == self.retries:
                    raise
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def generate(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                       policy: str = "cacheblend", order: str = "preserve",
                       tenant: str | None = None) -> GenerateResponse:
        body = _body(prompt, sampling, policy, order, tenant or self.tenant, False)
        result = GenerateResponse.model_validate((await self._request("POST", "/v1/generate", json=body)).json())
        self.last_result = result
        return result

    async def stream(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                     policy: str = "cacheblend", order: str = "preserve",
                     tenant: str | None = None) -> AsyncIterator[str]:
        body = _body(prompt, sampling, policy, order, tenant or self.tenant, True)
        async with self._http.stream("POST", "/v1/generate", json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for(response)
            async for line in response.aiter_lines():
                for event in _sse_events(iter([line])):
                    if event.get("type") == "delta":
                        yield event["text"]
                    elif event.get("type") == "done":
                        event.pop("type")
                        self.last_result = GenerateResponse.model_validate(event)

    async def warm(self, chunks: list[Chunk | str], system: str | None = None,
                   tenant: str | None = None) -> WarmResponse:
        body = WarmRequest(chunks=[Chunk(text=c) if isinstance(c, str) else c for c in chunks], system=system,
                           tenant=tenant or self.tenant).model_dump(mode="json", exclude_none=True)
        return WarmResponse.model_validate((await self._request("POST", "/v1/chunks/warm", json=body)).json())

    async def stats(self) -> CacheStats:
        return CacheStats.model_validate((await self._request("GET", "/v1/cache/stats")).json())

    async def health(self) -> dict[str, Any]:
        return (await self._request("GET", "/health")).json()

    async def aclose(self) -> None:
        await self._http.aclose()
