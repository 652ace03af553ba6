"""Cache-Craft: the planner's variant per chunk, its CFO share recomputed, early termination on
the question's focused chunks."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.policies.base import LayerView, Policy, span_masks
from ragcache_integrations.policy_registry import PolicySpec


class CacheCraftPolicy(Policy):
    """Cache-Craft: each fused chunk's variant was chosen by the planner at the lowest CFO, and
    its top ceil(CFO |C|) tokens by inter-attention are recomputed from layer 0
    (`PlanSpan.recompute`). With early termination (Algorithm 1), the question's attention over
    the fused chunks is checked per layer; once the set of focused chunks is the same for
    `window` layers, unfocused chunks stop being recomputed. When even the best variant's CFO
    reaches `fresh_above`, the chunk is computed in this request's context and becomes another
    variant."""

    records_variants = True

    name = "cachecraft"

    def __init__(self, alpha: float = 1.0, window: int = 3, early_stop: bool = True, fresh_above: float = 0.8):
        if alpha < 0 or window < 1:
            raise ValueError("alpha must be >= 0 and window >= 1")
        self.alpha, self.window, self.early_stop = alpha, window, early_stop
        # a best variant this costly to fix is not worth it: compute the chunk in this context
        # instead and keep the result as a new variant
        self.fresh_above = fresh_above
        self.reset()


    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        return cls(float(spec.value or 0.0), early_stop=not spec.option)
    def reset(self) -> None:
        self.stopped_at: int | None = None  # the layer early termination stopped at, if it did
        self._question = torch.zeros(0, dtype=torch.bool)
        self._chunks: list[tuple[int, int]] = []
        self._history: list[frozenset[int]] = []

    def decisions(self) -> dict[str, Any]:
        # the chunks (by their order among the fused ones) the question focused on, layer by layer
        # until the stop
        return {"stopped_at": self.stopped_at, "focused_by_layer": [sorted(seen) for seen in self._history]}

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
        active = span_masks(plan)[1]
        self._question = torch.zeros(plan.num_tokens, dtype=torch.bool)
        self._chunks, self._history, self.stopped_at = [], [], None
        for span in plan.spans:
            if span.kind == "question":
                self._question[span.start : span.end] = True
            if span.mode == "fuse":
                self._chunks.append((span.start, span.end))
                if span.recompute is not None and len(span.recompute):
                    active[span.start + span.recompute] = True
        return active

    def refine(self, view: LayerView) -> torch.Tensor | None:
        from engine_sidecar.execution.cachecraft import focused_chunks, termination_layer

        if not self.early_stop or self.stopped_at is not None or len(self._chunks) < 2:
            return None
        assert view.new_queries is not None and view.rope is not None and view.all_keys_pre is not None
        readers = self._question[view.active.cpu()].to(view.active.device)
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
        self._history.append(focused_chunks([float(mass[s:e].sum()) for s, e in self._chunks]))
        if not termination_layer(self._history, self.window):
            return None
        self.stopped_at = view.layer
        unfocused = torch.zeros(n, dtype=torch.bool)
        for i, (s, e) in enumerate(self._chunks):
            if i not in self._history[-1]:
                unfocused[s:e] = True
        return view.must_keep | ~unfocused[view.active.cpu()].to(view.active.device)
