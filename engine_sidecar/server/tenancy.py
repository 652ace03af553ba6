"""Tenant isolation on top of the engine's tenant-salted KV keys.

The engine salts every KV key with the tenant, but two pieces of its state are keyed by chunk id
alone: the CA-Table (access counts that drive `order="frequency"` and CP-Tree promotion) and the
chunk-id index behind `clear_cache(chunk_id)`. Left alone, tenant B's requests would change how
tenant A's prompts are ordered and promoted (a timing side channel), and B could delete A's
entries by id. So the server hands the engine tenant-scoped chunk ids and maps them back in
responses. An engine-side tenant key for both would make this module unnecessary.
"""

from __future__ import annotations

from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationResult

# Tenants match ^[A-Za-z0-9_.-]{1,64}$ and chunk ids may not hold control characters (checked
# in guards), so "tenant<US>id" can never collide with another tenant's id or a bare id.
_SEP = "\x1f"


def scope_id(chunk_id: str, tenant: str) -> str:
    return f"{tenant}{_SEP}{chunk_id}" if tenant else chunk_id


def unscope_id(chunk_id: str | None, tenant: str) -> str | None:
    prefix = f"{tenant}{_SEP}"
    if tenant and chunk_id and chunk_id.startswith(prefix):
        return chunk_id[len(prefix):]
    return chunk_id


def scope_chunks(chunks: list[Chunk], tenant: str) -> list[Chunk]:
    if not tenant:
        return chunks
    return [c.model_copy(update={"id": scope_id(c.id or "", tenant)}) for c in chunks]


def scope_prompt(prompt: ChunkedPrompt, tenant: str) -> ChunkedPrompt:
    if not tenant:
        return prompt
    return prompt.model_copy(update={"chunks": scope_chunks(prompt.chunks, tenant)})


def unscope_result(result: GenerationResult, tenant: str) -> GenerationResult:
    if not tenant:
        return result
    plan = [{**span, "chunk_id": unscope_id(span.get("chunk_id"), tenant)} for span in result.stats.plan]
    return result.model_copy(update={"stats": result.stats.model_copy(update={"plan": plan})})
