"""Cache-Craft: the planner's variant per chunk, its CFO share recomputed, early termination on
the question's focused chunks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.policies.base import (
    CacheUse,
    LayerView,
    Policy,
    PrefillView,
    Selection,
    VariantChoice,
    span_masks,
)
from ragcache_integrations.policy_registry import PolicySpec


@dataclass(frozen=True)
class CacheCraftPolicy(Policy):
    """Cache-Craft: each fused chunk's variant was chosen by the planner at the lowest CFO, and
    its top ceil(CFO |C|) tokens by inter-attention are recomputed from layer 0
    (`PlanSpan.recompute`). With early termination (Algorithm 1), the question's attention over
    the fused chunks is checked per layer; once the set of focused chunks is the same for
    `window` layers, unfocused chunks stop being recomputed. When even the best variant's CFO
    reaches `fresh_above`, the chunk is computed in this request's context and becomes another
    variant."""

    name = "cachecraft"
    alpha: float = 1.0
    window: int = 3
    early_stop: bool = True
    # a best variant this costly to fix is not worth it: compute the chunk in this context
    # instead and keep the result as a new variant
    fresh_above: float = 0.8

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.window < 1:
            raise ValueError("alpha must be >= 0 and window >= 1")

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> CacheCraftPolicy:
        return cls(float(spec.value or 0.0), early_stop=not spec.option)

    def cache_use(self) -> CacheUse:
        return CacheUse(variants=VariantChoice(self.alpha, self.fresh_above))

    def final_refine_layer(self, num_layers: int) -> int:
        return num_layers - 1 if self.early_stop else -1  # may stop early on any layer

    def select(self, view: PrefillView) -> Selection:
        active = span_masks(view.plan)[1]
        for span in view.plan.spans:
            if span.mode == "fuse" and span.recompute is not None and len(span.recompute):
                active[span.start + span.recompute] = True
        termination = _EarlyTermination.of(view.plan, self.window)
        useful = self.early_stop and len(termination.chunks) >= 2
        return Selection(active, refine=termination.refine if useful else None, decided=termination.decided)


@dataclass
class _EarlyTermination:
    """One request's Algorithm 1: the focused chunks per layer until `window` layers agree."""

    question: torch.Tensor  # [T] bool
    chunks: list[tuple[int, int]]  # the fused chunks' (start, end)
    window: int
    history: list[frozenset[int]] = field(default_factory=list)  # focused chunks, layer by layer
    # the chunks (by their order among the fused ones) the question focused on, layer by layer
    # until the stop, and the layer it stopped at: the request's stats
    decided: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: FusionPlan, window: int) -> _EarlyTermination:
        question = torch.zeros(plan.num_tokens, dtype=torch.bool)
        chunks = []
        for span in plan.spans:
            if span.kind == "question":
                question[span.start : span.end] = True
            if span.mode == "fuse":
                chunks.append((span.start, span.end))
        run = cls(question, chunks, window)
        run.decided.update(stopped_at=None, focused_by_layer=[])
        return run

    def refine(self, view: LayerView) -> torch.Tensor | None:
        from engine_sidecar.execution.cachecraft import focused_chunks, termination_layer

        if self.decided["stopped_at"] is not None:
            return None
        assert view.new_queries is not None and view.rope is not None and view.all_keys_pre is not None
        readers = self.question[view.active.cpu()].to(view.active.device)
        if not bool(readers.any()):
            return None
        n = view.all_keys_pre.shape[0]
        keys = view.all_keys_pre.clone()
        keys[view.active] = view.new_keys
        positions = torch.arange(n, device=keys.device)
        k = view.rope(keys, positions).float()
        q = view.rope(view.new_queries[readers], view.active[readers]).float()
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = torch.einsum("rhd,khd->hrk", q, k) / math.sqrt(q.shape[-1])
        visible = positions[None, :] <= view.active[readers][:, None]
        mass = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).mean(dim=(0, 1)).cpu()
        self.history.append(focused_chunks([float(mass[s:e].sum()) for s, e in self.chunks]))
        self.decided["focused_by_layer"].append(sorted(self.history[-1]))
        if not termination_layer(self.history, self.window):
            return None
        self.decided["stopped_at"] = view.layer
        unfocused = torch.zeros(n, dtype=torch.bool)
        for i, (s, e) in enumerate(self.chunks):
            if i not in self.history[-1]:
                unfocused[s:e] = True
        return view.must_keep | ~unfocused[view.active.cpu()].to(view.active.device)
