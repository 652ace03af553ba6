"""Response documentation shared by the routes, so /openapi.json lists every error a route gives."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from ragcache_integrations.api_models import ChatCompletionChunk, ErrorResponse

_ERRORS = {
    400: "Unreadable body (not UTF-8), empty question, tenant field and header disagree, an OpenAI feature the "
         "chat endpoint does not serve (tools, response_format, logprobs, penalties, logit_bias, n > 1)",
    401: "Missing or wrong API key (only with --api-key)",
    413: "Too many chunks, a chunk too long, body too large, or prompt + max_tokens over the context window",
    422: "Schema violation: unknown field, wrong type, value out of range, malformed JSON, bad tenant, a policy "
         "the engine cannot run (--engine vllm)",
    429: "Engine queue full; retry after the Retry-After header's seconds",
    501: "Not supported by this engine (deleting chunk KV with --engine vllm)",
    503: "Server shutting down, or (--engine vllm) vLLM exited or did not answer",
    504: "Request timeout (--request-timeout) passed",
}

ENGINE_ERRORS = (400, 401, 413, 422, 429, 503, 504)  # routes that queue engine work


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


# --- server-sent events ------------------------------------------------------------------------
# An event-stream's `schema` describes one event as schema checkers parse it (OpenAPI 3.1 with
# the 3.2 reading): {"event": name, "data": text}, "message" being the name of an event sent
# without one. Each `data` is JSON, described with contentMediaType + contentSchema.
def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_text(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


def _event(name: str, data: dict[str, Any], description: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "required": ["event", "data"],
            "properties": {"event": {"const": name}, "data": data}}


_STREAM_ERROR = {"allOf": [_ref("ErrorResponse"), {"type": "object", "required": ["type", "status"], "properties": {
    "type": {"const": "error"}, "status": {"type": "integer", "description": "The HTTP status it would have had"}}}]}

GENERATE_EVENT: dict[str, Any] = {"oneOf": [
    _event("message", _json_text({"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "delta"}, "text": {"type": "string"}}}), "A text delta (`data:` only)"),
    _event("done", _json_text({"allOf": [_ref("GenerateResponse"), {"type": "object", "required": ["type"],
                                                                     "properties": {"type": {"const": "done"}}}]}),
           "`event: done`: the whole GenerateResponse; the stream ends"),
    _event("error", _json_text(_STREAM_ERROR), "`event: error`: a failure after the first token; the stream ends"),
]}

CHAT_EVENT: dict[str, Any] = _event("message", {
    "type": "string",
    # OpenAI's framing: a ChatCompletionChunk per event, `{"error": ...}` for a failure after the
    # first token, and the literal `[DONE]` last
    "if": {"const": "[DONE]"},
    "else": _json_text({"anyOf": [_ref("ChatCompletionChunk"), _ref("ErrorResponse")]}),
}, "A ChatCompletionChunk, an error, or `[DONE]`")

# models the event schemas name that no route names: added to the components by install_openapi
STREAM_MODELS = (ChatCompletionChunk, ErrorResponse)


def sse_responses(event: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    """The 200 of a route answering JSON, or with `stream: true` server-sent events."""
    return {200: {"description": "JSON, or with `stream: true` a text/event-stream of events",
                  "content": {"text/event-stream": {"schema": event}}}}


def install_openapi(app: FastAPI) -> None:
    """FastAPI's schema plus the component schemas the event streams refer to."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _, defs = models_json_schema([(m, "serialization") for m in STREAM_MODELS],
                                         ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
