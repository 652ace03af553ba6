"""`Engine.warm`: chunks handed over ahead of any request, each checked against the context
window, then computed (alone, or after its nearest passages) and stored unless the store holds
it already."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine_sidecar.engine.request_prep import RequestPreparer
from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.request.prompt import Passage, PromptBuilder, Segment
from engine_sidecar.reuse.neighbours import NeighbourIndex
from engine_sidecar.reuse.precompute import Precomputer
from ragcache_integrations.types import Chunk, ChunkedPrompt

DEFAULT_SYSTEM = ChunkedPrompt.model_fields["system"].default
MAX_NEIGHBOURS = 8
# what a warm-up that leaves `neighbours` unset uses when it has passages to choose from: the
# only N that beat KV computed alone on both QA sets' calibration splits (notes/benchmarks-lab.md,
# "How many neighbours")
DEFAULT_NEIGHBOURS = 2

Pool = Sequence[Chunk | str] | NeighbourIndex | None


def _chunk(raw: Chunk | str) -> Chunk:
    return Chunk(text=raw) if isinstance(raw, str) else raw


@dataclass(frozen=True)
class WarmReport:
    """What a warm-up did and what it cost."""

    chunks: int  # handed over
    computed: int  # computed now (the rest were cached already)
    neighbours: int  # passages each chunk was computed after (0: alone)
    tokens_prefilled: int  # what those chunks cost: their own tokens, their neighbours' and a new template's
    seconds: float


def auto_neighbours(passages: int) -> int:
    """The neighbours a warm-up of `passages` distinct passages known together uses when the
    caller leaves them unset: none for a lone passage, which has nothing to be computed after."""
    return DEFAULT_NEIGHBOURS if passages >= 2 else 0


def neighbour_index(builder: PromptBuilder, chunks: Sequence[Chunk | str]) -> NeighbourIndex:
    """A pool of passages to choose warm-up neighbours from; build it once for many warm calls."""
    return NeighbourIndex.build([_whole(builder.passage(_chunk(c))) for c in chunks if _chunk(c).text.strip()])


def _whole(passage: Passage) -> Segment:
    """A passage as one segment, every token of it: what a neighbour contributes before a chunk."""
    return Segment("chunk", tuple(t for s in passage.segments for t in s.token_ids), passage.core.chunk_id)


def warm_chunks(builder: PromptBuilder, prep: RequestPreparer, precompute: Precomputer, chunks: list[Chunk | str],
                system: str | None, tenant: str, neighbours: int | None = 0, pool: Pool = None) -> WarmReport:
    """Each chunk not cached yet computed and stored. With `neighbours` > 0 each is computed after
    the template prefix and its `neighbours` most similar passages of `pool` (default: these
    chunks) and kept as its in-context entry; None picks `auto_neighbours` of the pool."""
    started = time.perf_counter()
    if neighbours is not None and not 0 <= neighbours <= MAX_NEIGHBOURS:
        raise InvalidPromptError(f"neighbours must be 0 to {MAX_NEIGHBOURS}, got {neighbours}")
    prefix = builder.prefix_segment(system if system is not None else DEFAULT_SYSTEM)
    passages: list[Passage] = []
    for i, raw in enumerate(chunks):
        passage = builder.passage(_chunk(raw))
        prep.check_chunk_fits(_whole(passage), i)
        passages.append(passage)
    # a one-word passage has no core: nothing of it is cached, every request computes it
    cached = [p for p in passages if p.core.token_ids]
    index = None
    if neighbours != 0:
        index = pool if isinstance(pool, NeighbourIndex) else NeighbourIndex.build(
            [_whole(p) for p in passages] if pool is None else [_whole(builder.passage(_chunk(c))) for c in pool
                                                                if _chunk(c).text.strip()])
        neighbours = auto_neighbours(len(index.segments)) if neighbours is None else neighbours
    tokens = []
    for passage in cached:
        if index is None or not neighbours:
            tokens.append(precompute.warm_segment(passage.core, prefix, tenant, passage.head.token_ids))
            continue
        whole = _whole(passage)
        context = index.nearest(whole, neighbours)
        # the least similar neighbours give way first when the window cannot hold them all
        while context and len(prefix.token_ids) + sum(len(s.token_ids) for s in [*context, whole]) >= prep.max_context:
            context = context[1:]
        tokens.append(precompute.warm_after_neighbours(passage, prefix, context, tenant))
    return WarmReport(len(passages), sum(1 for t in tokens if t), neighbours or 0, sum(tokens),
                      time.perf_counter() - started)
