"""One error shape for every failure: `{"error": {message, type, field, param, code}}`.

User mistakes are 4xx naming the field and the limit; only bugs reach the catch-all 500, and
that one never echoes internals.
"""

from __future__ import annotations

import json
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_sidecar.errors import RagCacheError
from ragcache_integrations.api_models import ErrorBody, ErrorResponse

_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.field, self.code, self.headers = status, message, field, code, headers


def error_body(status: int, message: str, field: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorBody(message=message, type=kind, field=field, param=field,
                                         code=code)).model_dump()


def error_response(status: int, message: str, field: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, field, code), status_code=status, headers=headers)


def engine_error_status(exc: RagCacheError) -> int:
    return exc.http_status


# pydantic names the member of a union in the error location ("str", "list[TextPart]"); a
# client wants the field path only
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


def _field_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p))]
    if parts and parts[0] in ("body", "header", "query", "path"):
        return ".".join(parts[1:]) or parts[0]  # the body itself (e.g. not an object) is "body"
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.field, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # the deepest location is the most specific: for a union, the member the input came closest to
        first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {"loc": (), "msg": "invalid request",
                                                                                   "type": "invalid"}
        if first.get("type") == "json_invalid":
            return error_response(422, f"body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}",
                                  None, "json_invalid")
        field = _field_of(tuple(first.get("loc", ())))
        inner = (first.get("ctx") or {}).get("path") if first.get("type") == "string_not_utf8" else None
        if inner:  # raised for the whole body: the offending field is in the error's context
            field = f"{field}.{inner}" if field and field != "body" else inner
        message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return error_response(422, message, field, str(first.get("type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI turns a body it cannot decode into a bare 400; say why when we can tell
        if isinstance(exc.__cause__, UnicodeDecodeError):
            return error_response(400, f"body is not valid UTF-8 ({exc.__cause__.reason} at byte "
                                       f"{exc.__cause__.start}); send UTF-8 JSON", None, "body_not_utf8")
        if isinstance(exc.__cause__, json.JSONDecodeError | ValueError):
            return error_response(400, f"body could not be read: {exc.__cause__}", None, "body_unreadable")
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "field", None),
                              getattr(exc, "code", None), exc.headers)

    @app.exception_handler(RagCacheError)
    async def _engine(_: Request, exc: RagCacheError) -> JSONResponse:
        return error_response(engine_error_status(exc), str(exc), None, type(exc).__name__)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after sending this, so uvicorn logs the traceback once
        return error_response(500, "internal error; the server log has the details", None, "internal_error")
