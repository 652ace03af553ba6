"""Which passages a chunk is warmed after (FusionRAG-style context-conditioned precompute).

A chunk precomputed alone has never attended to another passage, and its first token turns
into a spurious attention sink; fused later among other passages, that KV is furthest from
what full prefill computes. Warming it after the passages most like it instead gives KV close
to what a request that retrieves it together with those passages would compute.

"Most like it" is TF-IDF cosine over the model's own token ids: no second model in the
sidecar, deterministic, and near-duplicate facts and shared entity names (what multi-hop
retrieval brings together) are lexical overlap.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from engine_sidecar.request.prompt import Segment


def _weights(token_ids: tuple[int, ...], idf: dict[int, float], unseen_idf: float) -> dict[int, float]:
    counts = Counter(token_ids)
    vec = {t: (1.0 + math.log(c)) * idf.get(t, unseen_idf) for t, c in counts.items()}
    norm = math.sqrt(sum(w * w for w in vec.values())) or 1.0
    return {t: w / norm for t, w in vec.items()}


def cosine(a: dict[int, float], b: dict[int, float]) -> float:
    if len(a) > len(b):
        a, b = b, a
    return sum(w * b.get(t, 0.0) for t, w in a.items())


@dataclass(frozen=True)
class NeighbourIndex:
    """A pool of chunk segments and their TF-IDF vectors (idf from the pool itself)."""

    segments: tuple[Segment, ...]
    vectors: tuple[dict[int, float], ...]
    idf: dict[int, float]
    unseen_idf: float

    @classmethod
    def build(cls, segments: list[Segment]) -> NeighbourIndex:
        unique: dict[tuple[int, ...], Segment] = {}
        for seg in segments:
            unique.setdefault(seg.token_ids, seg)
        pool = tuple(unique.values())
        n = len(pool)
        df = Counter(t for seg in pool for t in set(seg.token_ids))
        # smoothed idf: a token in every passage still counts a little
        idf = {t: math.log((1 + n) / (1 + d)) + 1.0 for t, d in df.items()}
        unseen = math.log(1 + n) + 1.0
        return cls(pool, tuple(_weights(s.token_ids, idf, unseen) for s in pool), idf, unseen)

    def nearest(self, seg: Segment, m: int) -> list[Segment]:
        """The m pool passages most like `seg` (itself excluded), least similar first, so the
        most similar one sits right before the chunk. Ties keep pool order."""
        if m <= 0:
            return []
        query = _weights(seg.token_ids, self.idf, self.unseen_idf)
        scored = [(cosine(query, vec), -index)
                  for index, (other, vec) in enumerate(zip(self.segments, self.vectors, strict=True))
                  if other.token_ids != seg.token_ids]
        best = sorted(scored, reverse=True)[:m]  # on a tie the earlier pool passage ranks higher
        return [self.segments[-neg_index] for _, neg_index in reversed(best)]
