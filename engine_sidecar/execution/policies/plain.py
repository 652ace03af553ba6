"""The policies that choose without looking at the KV: full prefill, exact prefix reuse, reuse as
is, and EPIC's chunk heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_sidecar.execution.policies.base import CacheUse, Policy, PrefillView, Selection, span_masks
from ragcache_integrations.policy_registry import PolicySpec


@dataclass(frozen=True)
class FullPolicy(Policy):
    """No reuse at all: the ordinary prefill every benchmark compares against."""

    name = "full"

    def cache_use(self) -> CacheUse:
        return CacheUse(lookup=False, fuses=False)

    def select(self, view: PrefillView) -> Selection:
        return Selection(torch.ones(view.plan.num_tokens, dtype=torch.bool))


@dataclass(frozen=True)
class PrefixPolicy(Policy):
    """Exact prefix reuse only (what vLLM/SGLang prefix caching gives, at chunk granularity):
    the template prefix, a conversation's history and the longest CP-Tree path are reused;
    everything after them is computed with full attention."""

    name = "prefix"

    def cache_use(self) -> CacheUse:
        return CacheUse(fuses=False)


@dataclass(frozen=True)
class ReusePolicy(Policy):
    """Reuse every cached chunk as is (rotated), recompute nothing."""

    name = "reuse"

    def select(self, view: PrefillView) -> Selection:
        return Selection(span_masks(view.plan)[1], fixed=True)


@dataclass(frozen=True)
class EpicPolicy(Policy):
    """EPIC: recompute the first k tokens of each fused chunk (its spurious attention sink)."""

    name = "epic"
    k: int = 16

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> EpicPolicy:
        return cls(int(spec.value or 0))

    def select(self, view: PrefillView) -> Selection:
        active = span_masks(view.plan)[1]
        for span in view.plan.spans:
            if span.mode == "fuse":
                active[span.start : span.start + min(self.k, len(span))] = True
        return Selection(active, fixed=True)
