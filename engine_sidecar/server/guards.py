"""Request guards that run before any engine work: API key, tenant, and size limits.

Each failure is an ApiError naming the field and the limit, so a client can fix its request
without reading server logs.
"""

from __future__ import annotations

import re
import secrets
import unicodedata
from collections.abc import Callable
from typing import Annotated, Protocol

from fastapi import Depends, Header
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from engine_sidecar.server.errors import ApiError
from engine_sidecar.server.settings import ServerSettings
from ragcache_integrations.api_models import TENANT_HEADER, TENANT_PATTERN
from ragcache_integrations.policy_registry import PolicySpecError, parse_policy_spec
from ragcache_integrations.types import Chunk, SamplingParams

_bearer = HTTPBearer(auto_error=False, description="Only when the server runs with --api-key")


def auth_dependency(settings: ServerSettings) -> Callable[..., None]:
    expected = settings.api_key

    def authorize(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        if not expected:
            return
        # constant-time compare: the key must not leak through response timing
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authorization",
                           "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    return authorize


def tenant_header(
    x_ragcache_tenant: Annotated[str | None, Header(alias=TENANT_HEADER, pattern=TENANT_PATTERN,
                                                    description="Tenant that salts the cache keys")] = None,
) -> str | None:
    return x_ragcache_tenant


TenantHeader = Annotated[str | None, Depends(tenant_header)]


def resolve_tenant(field_value: str | None, header_value: str | None) -> str:
    """The body field wins over the header; both given and different is a client bug worth naming."""
    if field_value and header_value and field_value != header_value:
        raise ApiError(400, f"tenant field '{field_value}' and {TENANT_HEADER} header '{header_value}' disagree",
                       "tenant", "tenant_mismatch")
    tenant = field_value or header_value or ""
    if tenant and not re.fullmatch(TENANT_PATTERN, tenant):  # both already validated; kept as a last line
        raise ApiError(422, f"tenant must match {TENANT_PATTERN}", "tenant", "invalid_tenant")
    return tenant


class PolicyChecker(Protocol):
    def check_policy(self, policy: str) -> None: ...  # raises ApiError for a policy it cannot run


def check_policy(policy: str, backend: PolicyChecker) -> None:
    """The request's policy against the grammar the engine's parser uses, then against what the
    backend can run: a typo or an unsupported policy fails fast (naming the valid forms) instead
    of waiting in the engine queue."""
    try:
        parse_policy_spec(policy)
    except PolicySpecError as exc:
        raise ApiError(422, f"policy: {exc}", "policy", "invalid_policy") from None
    backend.check_policy(policy)


def check_chunks(chunks: list[Chunk], settings: ServerSettings, field: str = "chunks") -> None:
    if len(chunks) > settings.max_chunks:
        raise ApiError(413, f"{field}: {len(chunks)} chunks sent; the limit is {settings.max_chunks}", field,
                       "too_many_chunks")
    for i, chunk in enumerate(chunks):
        if len(chunk.text) > settings.max_chunk_chars:
            raise ApiError(413, f"{field}[{i}].text has {len(chunk.text)} characters; the limit is "
                                f"{settings.max_chunk_chars}", f"{field}.{i}.text", "chunk_too_long")
        chunk_id = chunk.id or ""
        if len(chunk_id) > settings.max_chunk_id_chars:
            raise ApiError(422, f"{field}[{i}].id has {len(chunk_id)} characters; the limit is "
                                f"{settings.max_chunk_id_chars}", f"{field}.{i}.id", "chunk_id_too_long")
        if any(unicodedata.category(ch) == "Cc" for ch in chunk_id):
            raise ApiError(422, f"{field}[{i}].id contains control characters", f"{field}.{i}.id", "invalid_chunk_id")


def check_stops(stops: list[str], settings: ServerSettings, field: str) -> None:
    if len(stops) > settings.max_stop_strings:
        raise ApiError(422, f"{field}: {len(stops)} stop strings; the limit is {settings.max_stop_strings}", field,
                       "too_many_stops")
    if any(not s for s in stops):
        raise ApiError(422, f"{field}: stop strings must not be empty", field, "empty_stop")
    for i, stop in enumerate(stops):
        if len(stop) > settings.max_stop_chars:
            raise ApiError(422, f"{field}[{i}] has {len(stop)} characters; the limit is {settings.max_stop_chars}",
                           f"{field}.{i}", "stop_too_long")


def cap_max_tokens(sampling: SamplingParams, explicit: bool, settings: ServerSettings, field: str) -> SamplingParams:
    """A max_tokens the client asked for must be within --max-tokens; a default is lowered to it."""
    if sampling.max_tokens <= settings.max_tokens:
        return sampling
    if explicit:
        raise ApiError(422, f"{field} is {sampling.max_tokens}; this server's limit is {settings.max_tokens} "
                            "(--max-tokens)", field, "max_tokens_over_limit")
    return sampling.model_copy(update={"max_tokens": settings.max_tokens})
