"""Question-driven selection before layer 0: prophet (a probe's scores) and gate (the probe's
first-token confidence decides whether to spend the budget)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.policies.base import CacheUse, PrefillView, RatioPolicy, Selection, span_masks
from ragcache_integrations.policy_registry import PolicySpec


@dataclass(frozen=True)
class ProphetPolicy(RatioPolicy):
    """Question-driven multi-layer selection (ProphetKV, A3; CacheClip windows): a probe runs the
    question (and any fresh chunk) through every layer over the reused KV and scores each fused
    token by the question's attention, normalized per head and averaged over layers
    (`question_probe.probe_scores`); the top-r fused tokens, each with `radius` neighbours on both
    sides, are recomputed from layer 0 on every layer. The budget ceil(r x fused tokens) includes
    the windows; `layers` stops the probe after the first L layers (scores averaged over those).
    At r = 1 every fused token is recomputed (full prefill) and no probe runs."""

    name = "prophet"
    radius: int = 1
    layers: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0 or self.radius < 0:
            raise InvalidPromptError(f"{self.name} ratio must be in [0, 1] and radius >= 0, got {self.ratio}, "
                                     f"{self.radius}")
        if self.layers is not None and self.layers < 1:
            raise InvalidPromptError(f"{self.name} probe layers must be >= 1, got {self.layers}")

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> ProphetPolicy:
        return cls(float(spec.value or 0.0), radius=0 if spec.option else 1, layers=spec.probe_layers)

    def cache_use(self) -> CacheUse:
        return CacheUse(reads_all_layers_first=True)  # the probe reads every cached layer before layer 0

    def select(self, view: PrefillView) -> Selection:
        from engine_sidecar.execution.question_probe import probe_scores

        plan = view.plan
        fused, fresh = span_masks(plan)
        budget = self._budget(fused)
        work = 0
        if budget >= int(fused.sum()) or budget <= 0:  # all or nothing: no scores needed
            picked = fused if budget > 0 else torch.zeros_like(fused)
        else:
            scores, work = probe_scores(view.runner, plan, self.layers, view.reused)
            picked = self._top(scores, fused, budget, plan)
        return self._selection(fresh, picked, work, {})

    def _budget(self, fused: torch.Tensor) -> int:
        """Fused tokens to recompute."""
        return min(math.ceil(self.ratio * int(fused.sum()) - 1e-9), int(fused.sum()))

    def _top(self, scores: torch.Tensor, fused: torch.Tensor, budget: int, plan: FusionPlan) -> torch.Tensor:
        from engine_sidecar.execution.question_probe import select_with_windows

        segments = [(s.start, s.end) for s in plan.spans if s.mode == "fuse"]
        return select_with_windows(scores, fused, budget, self.radius, segments)

    def _selection(self, fresh: torch.Tensor, picked: torch.Tensor, work: int, decided: dict) -> Selection:
        return Selection(fresh | picked, fixed=True, token_layers=work,
                         decided={**self.decided(), "probe_token_layers": work, "selected": int(picked.sum()),
                                  **decided})


@dataclass(frozen=True)
class GatePolicy(ProphetPolicy):
    """Confidence-gated budget: the prophet probe runs the question over the reused
    KV through every layer and, for the last prompt token, on to the next-token distribution,
    which is exactly what `reuse` would answer first. Where that prediction is confident
    (p(top 1) - p(top 2) >= `threshold`) nothing is recomputed (plain reuse); otherwise the
    top-ratio fused tokens by the probe's scores, with windows, are recomputed as under
    `prophet:ratio`. The cost therefore varies per request: the probe always, the budget only
    where the margin is small. At ratio 1 every fused token is recomputed and no probe runs."""

    name = "gate"
    ratio: float = 0.3
    # p(top 1) - p(top 2) at or above which reuse's first token is trusted
    threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not math.isfinite(self.threshold):
            raise InvalidPromptError(f"gate threshold must be a finite number, got {self.threshold}")

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> GatePolicy:
        return cls(float(spec.value or 0.0))

    def select(self, view: PrefillView) -> Selection:
        from engine_sidecar.execution.question_probe import first_token_margin, probe

        plan = view.plan
        fused, fresh = span_masks(plan)
        budget = self._budget(fused)
        if budget >= int(fused.sum()) or budget <= 0:  # all or nothing: no decision to make
            picked = fused if budget > 0 else torch.zeros_like(fused)
            return self._selection(fresh, picked, 0, {"escalated": budget > 0, "margin": None})
        result = probe(view.runner, plan, logits=True, reused=view.reused)
        margin = first_token_margin(result.logits) if result.logits is not None else math.nan
        # no prediction (nan) is no confidence: spend the budget
        escalated = not margin >= self.threshold
        if escalated:
            picked = self._top(result.scores, fused, budget, plan)
            plan.notes.append(f"gate: first-token margin {margin:.3f} < {self.threshold:g}: "
                              f"top {self.ratio:g} of the fused tokens recomputed")
        else:
            picked = torch.zeros_like(fused)
            plan.notes.append(f"gate: first-token margin {margin:.3f} >= {self.threshold:g}: reused as is")
        return self._selection(fresh, picked, result.token_layers,
                               {"escalated": escalated, "margin": None if math.isnan(margin) else margin})
