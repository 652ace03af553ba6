"""`Engine.warm`: chunks handed over ahead of any request, each checked against the context
window, then computed alone and stored unless the store holds it already."""

from __future__ import annotations

from engine_sidecar.precompute import Precomputer
from engine_sidecar.prompt import PromptBuilder
from engine_sidecar.request_prep import RequestPreparer
from ragcache_integrations.types import Chunk, ChunkedPrompt

DEFAULT_SYSTEM = ChunkedPrompt.model_fields["system"].default


def warm_chunks(builder: PromptBuilder, prep: RequestPreparer, precompute: Precomputer, chunks: list[Chunk | str],
                system: str | None, tenant: str) -> int:
    """How many chunks were computed (the rest were cached already)."""
    prefix = builder.prefix_segment(system if system is not None else DEFAULT_SYSTEM)
    computed = 0
    for i, raw in enumerate(chunks):
        chunk = Chunk(text=raw) if isinstance(raw, str) else raw
        seg = builder.chunk_segment(chunk)
        prep.check_chunk_fits(seg, i)
        computed += precompute.warm_segment(seg, prefix, tenant)
    return computed
