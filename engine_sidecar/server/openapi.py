"""Response documentation shared by the routes, so /openapi.json lists every error a route gives."""

from __future__ import annotations

from typing import Any

from ragcache_integrations.api_models import ErrorResponse

_ERRORS = {
    400: "Unreadable body (not UTF-8), empty question, tenant field and header disagree",
    401: "Missing or wrong API key (only with --api-key)",
    413: "Too many chunks, a chunk too long, body too large, or prompt + max_tokens over the context window",
    422: "Schema violation: unknown field, wrong type, value out of range, malformed JSON, bad tenant",
    429: "Engine queue full; retry after the Retry-After header's seconds",
    503: "Server shutting down",
    504: "Request timeout (--request-timeout) passed",
}

ENGINE_ERRORS = (400, 401, 413, 422, 429, 503, 504)  # routes that queue engine work


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}

SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"description": "JSON, or with `stream: true` a text/event-stream of events",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
}
