"""The policies that choose without looking at the KV: full prefill, exact prefix reuse, reuse as
is, and EPIC's chunk heads."""

from __future__ import annotations

import torch

from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.policies.base import Policy, span_masks
from ragcache_integrations.policy_registry import PolicySpec


class FullPolicy(Policy):
    """No reuse at all: the ordinary prefill every benchmark compares against."""

    name = "full"
    uses_cache = False
    fuses = False

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
        return torch.ones(plan.num_tokens, dtype=torch.bool)


class PrefixPolicy(Policy):
    """Exact prefix reuse only (what vLLM/SGLang prefix caching gives, at chunk granularity):
    the template prefix, a conversation's history and the longest CP-Tree path are reused;
    everything after them is computed with full attention."""

    name = "prefix"
    fuses = False


class ReusePolicy(Policy):
    """Reuse every cached chunk as is (rotated), recompute nothing."""

    name = "reuse"
    keeps_initial_active = True


class EpicPolicy(Policy):
    """EPIC: recompute the first k tokens of each fused chunk (its spurious attention sink)."""

    name = "epic"
    keeps_initial_active = True

    def __init__(self, k: int = 16):
        self.k = k

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        return cls(int(spec.value or 0))

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
        active = span_masks(plan)[1]
        for span in plan.spans:
            if span.mode == "fuse":
                active[span.start : span.start + min(self.k, len(span))] = True
        return active
