"""`Engine.warm`: chunks handed over ahead of any request, each checked against the context
window, then computed (alone, or after its nearest passages) and stored unless the store holds
it already."""

from __future__ import annotations

from collections.abc import Sequence

from engine_sidecar.engine.request_prep import RequestPreparer
from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.request.prompt import PromptBuilder, Segment
from engine_sidecar.reuse.neighbours import NeighbourIndex
from engine_sidecar.reuse.precompute import Precomputer
from ragcache_integrations.types import Chunk, ChunkedPrompt

DEFAULT_SYSTEM = ChunkedPrompt.model_fields["system"].default
MAX_NEIGHBOURS = 8

Pool = Sequence[Chunk | str] | NeighbourIndex | None


def _chunk(raw: Chunk | str) -> Chunk:
    return Chunk(text=raw) if isinstance(raw, str) else raw


def neighbour_index(builder: PromptBuilder, chunks: Sequence[Chunk | str]) -> NeighbourIndex:
    """A pool of passages to choose warm-up neighbours from; build it once for many warm calls."""
    return NeighbourIndex.build([builder.chunk_segment(_chunk(c)) for c in chunks])


def warm_chunks(builder: PromptBuilder, prep: RequestPreparer, precompute: Precomputer, chunks: list[Chunk | str],
                system: str | None, tenant: str, neighbours: int = 0, pool: Pool = None) -> int:
    """How many chunks were computed (the rest were cached already). With `neighbours` > 0 each
    chunk is computed after the template prefix and its `neighbours` most similar passages of
    `pool` (default: these chunks) and kept as its in-context entry."""
    if not 0 <= neighbours <= MAX_NEIGHBOURS:
        raise InvalidPromptError(f"neighbours must be 0 to {MAX_NEIGHBOURS}, got {neighbours}")
    prefix = builder.prefix_segment(system if system is not None else DEFAULT_SYSTEM)
    segs: list[Segment] = []
    for i, raw in enumerate(chunks):
        seg = builder.chunk_segment(_chunk(raw))
        prep.check_chunk_fits(seg, i)
        segs.append(seg)
    if not neighbours:
        return sum(precompute.warm_segment(seg, prefix, tenant) for seg in segs)
    index = pool if isinstance(pool, NeighbourIndex) else NeighbourIndex.build(
        segs if pool is None else [builder.chunk_segment(_chunk(c)) for c in pool])
    computed = 0
    for seg in segs:
        context = index.nearest(seg, neighbours)
        # the least similar neighbours give way first when the window cannot hold them all
        while context and len(prefix.token_ids) + sum(len(s.token_ids) for s in [*context, seg]) >= prep.max_context:
            context = context[1:]
        computed += precompute.warm_after_neighbours(seg, prefix, context, tenant)
    return computed
