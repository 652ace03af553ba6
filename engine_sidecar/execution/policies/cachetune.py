"""CacheTune: tokens chosen by the frequency scores of their cached KV."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine_sidecar.execution.policies.base import PrefillView, RatioPolicy, Selection, span_masks
from engine_sidecar.store.frequency import DEFAULT_CUTOFF, frequency_scores
from ragcache_integrations.policy_registry import PolicySpec


@dataclass(frozen=True)
class CacheTunePolicy(RatioPolicy):
    """CacheTune: recompute, from layer 0, the top-r tokens of each fused chunk by frequency score
    (`frequency_scores` of its cached K/V, stored with the chunk on the disk tier); the rest keep
    their cached KV. The chosen tokens stay chosen on every layer, so a chunk read from disk needs
    only the other tokens' rows (sparse load)."""

    name = "cachetune"
    cutoff: float = DEFAULT_CUTOFF

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0 or not 0.0 < self.cutoff <= 1.0:
            raise ValueError("ratio must be in [0, 1] and cutoff in (0, 1]")

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> CacheTunePolicy:
        return cls(float(spec.value or 0.0), auto=spec.auto)

    def select(self, view: PrefillView) -> Selection:
        plan = view.plan
        active = span_masks(plan)[1]
        for span in plan.spans:
            if span.mode != "fuse" or span.cached is None:
                continue
            budget = math.ceil(self.ratio * len(span) - 1e-9)  # 0.2 * 35 must be 7, not 8
            if budget == 0:
                continue
            entry = span.cached
            if entry.scores is not None and self.cutoff == DEFAULT_CUTOFF:
                scores = entry.scores
            else:
                if entry.reader is not None:  # scores need every layer: read the chunk whole now
                    entry.reader.read_into(entry)
                scores = frequency_scores(entry.keys, entry.values, self.cutoff)
            top = torch.topk(scores, min(budget, len(span))).indices
            active[span.start + top.cpu()] = True
        return Selection(active, fixed=True, decided=self.decided())
