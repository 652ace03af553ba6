"""Cache keys: the one place that names stored KV (model, tokenizer, tokens, tenant, context)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine_sidecar.request.fingerprint import token_ids_digest
from engine_sidecar.request.prompt import Segment
from engine_sidecar.store.entry import CacheKey


class CPNodeLike(Protocol):
    chunk_digest: str
    path_digest: str
    tenant: str


@dataclass(frozen=True)
class KeyFactory:
    model_fp: str
    tokenizer_fp: str
    convention: str  # "isolated" or "after-prefix": the context a chunk precomputed alone is keyed under

    def for_tokens(self, token_ids: tuple[int, ...] | list[int], tenant: str, context: str) -> CacheKey:
        return self.for_digest(token_ids_digest(token_ids), tenant, context)

    def for_digest(self, tokens_digest: str, tenant: str, context: str) -> CacheKey:
        return CacheKey(self.model_fp, self.tokenizer_fp, tokens_digest, tenant, context)

    def for_node(self, node: CPNodeLike) -> CacheKey:
        """A CP-Tree node's KV: the chunk's tokens after exactly the path from its root."""
        return self.for_digest(node.chunk_digest, node.tenant, "path:" + node.path_digest)

    def chunk_context(self, prefix: Segment) -> str:
        """The context of a chunk's KV computed alone (warm-ups, inline and background precompute)."""
        if self.convention == "after-prefix":
            return "after:" + token_ids_digest(prefix.token_ids)
        return "isolated"
