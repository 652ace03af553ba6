"""`oracle:<ratio>`: a bench-only selection that knows full prefill's KV.

It recomputes, from layer 0 on every layer, the fused tokens whose reused (cached) KV differs most
from the KV full prefill computes for the same prompt, summed over layers. No deployable selector
has full prefill's KV (computing it is the cost reuse avoids), so this is a reference point: what
selection by true deviation reaches at a given budget. It is not a proof of optimality (a token's
own deviation is not its effect on the answer, and recomputed tokens change their neighbours'
needs), but a selector that falls far below it at the same budget is choosing badly.

Only `ragcache bench fidelity` builds it (it needs full prefill's KV of the very prompt); the
server's policy registry does not know the name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.policies import CacheUse, PrefillView, RatioPolicy, Selection, span_masks
from ragcache_lab.policy_specs import ORACLE

NAME = ORACLE
HEAD = 16  # a chunk's first tokens, where the isolated convention's attention sink sits


def kv_deviation(plan: FusionPlan, full_keys_pre: torch.Tensor, full_values: torch.Tensor) -> torch.Tensor:
    """Per prompt token [T]: how far the KV the plan reuses is from full prefill's, summed over
    layers; -inf for tokens that are not fused. Per layer, a token's squared key and value errors
    are each divided by that layer's mean squared norm of full prefill's keys / values over the
    fused tokens, so layers with large activations do not drown the others.
    full_keys_pre / full_values: [L, T, Hkv, D], keys before RoPE (as the store keeps them)."""
    n = plan.num_tokens
    if full_keys_pre.shape[1] != n or full_values.shape[1] != n:
        raise ValueError(f"full prefill's KV covers {full_keys_pre.shape[1]} tokens, the plan {n}")
    fused = span_masks(plan)[0]
    layers = full_keys_pre.shape[0]
    key_err = torch.zeros(layers, n)
    value_err = torch.zeros(layers, n)
    for span in plan.spans:
        if span.mode != "fuse" or span.cached is None:
            continue
        entry = span.cached
        if entry.reader is not None:  # still on disk: read it whole now
            entry.reader.read_into(entry)
        s, e = span.start, span.end
        key_err[:, s:e] = (entry.keys.float() - full_keys_pre[:, s:e].float()).pow(2).sum(dim=(2, 3)).cpu()
        value_err[:, s:e] = (entry.values.float() - full_values[:, s:e].float()).pow(2).sum(dim=(2, 3)).cpu()
    scores = torch.full((n,), float("-inf"))
    if not bool(fused.any()):
        return scores
    key_scale = full_keys_pre[:, fused].float().pow(2).sum(dim=(2, 3)).mean(dim=1).cpu().clamp_min(1e-12)
    value_scale = full_values[:, fused].float().pow(2).sum(dim=(2, 3)).mean(dim=1).cpu().clamp_min(1e-12)
    total = (key_err / key_scale[:, None] + value_err / value_scale[:, None]).sum(dim=0)
    scores[fused] = total[fused]
    return scores


@dataclass(frozen=True, eq=False)
class OraclePolicy(RatioPolicy):
    """Recompute the top ceil(r * fused tokens) by `kv_deviation` from layer 0; the rest keep
    their cached KV. At r = 1 every fused token is recomputed: full prefill. Its stats say what
    share of the picks sit in their chunk's first HEAD tokens (`head_share`)."""

    name = NAME
    full_keys_pre: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    full_values: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise InvalidPromptError(f"oracle ratio must be in [0, 1], got {self.ratio}")

    def cache_use(self) -> CacheUse:
        return CacheUse(reads_all_layers_first=True)  # the deviation reads every cached layer before layer 0

    def select(self, view: PrefillView) -> Selection:
        plan = view.plan
        fused, fresh = span_masks(plan)
        active = fresh.clone()
        budget = min(math.ceil(self.ratio * int(fused.sum()) - 1e-9), int(fused.sum()))
        selected = torch.zeros(0, dtype=torch.long)  # global indices picked
        if budget > 0:
            scores = kv_deviation(plan, self.full_keys_pre, self.full_values)
            selected = torch.topk(scores, budget).indices.sort().values
            active[selected] = True
        # where the picks sit: CacheBlend's concentrate in each chunk's first tokens (the sink)
        head = torch.zeros(plan.num_tokens, dtype=torch.bool)
        for span in plan.spans:
            if span.mode == "fuse":
                head[span.start : span.start + min(HEAD, len(span))] = True
        head_share = float(head[selected].float().mean()) if len(selected) else 0.0
        return Selection(active, fixed=True, decided={"head_share": head_share})
