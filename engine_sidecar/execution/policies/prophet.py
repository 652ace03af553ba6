"""Question-driven selection before layer 0: prophet (a probe's scores) and gate (the probe's
first-token confidence decides whether to spend the budget)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.policies.base import Policy, span_masks
from ragcache_integrations.policy_registry import PolicySpec

if TYPE_CHECKING:
    from engine_sidecar.execution.question_probe import ReusedKV
    from engine_sidecar.model.runner import ModelRunner


class ProphetPolicy(Policy):
    """Question-driven multi-layer selection (ProphetKV, A3; CacheClip windows): a probe runs the
    question (and any fresh chunk) through every layer over the reused KV and scores each fused
    token by the question's attention, normalized per head and averaged over layers
    (`prophet.probe_scores`); the top-r fused tokens, each with `radius` neighbours on both sides,
    are recomputed from layer 0 on every layer. The budget ceil(r x fused tokens) includes the
    windows; `layers` stops the probe after the first L layers (scores averaged over those). At
    r = 1 every fused token is recomputed (full prefill) and no probe runs."""

    name = "prophet"
    needs_cached_kv = True  # the probe reads every cached layer before layer 0
    keeps_initial_active = True

    def __init__(self, ratio: float = 0.15, radius: int = 1, layers: int | None = None):
        if not 0.0 <= ratio <= 1.0 or radius < 0:
            raise InvalidPromptError(f"{self.name} ratio must be in [0, 1] and radius >= 0, got {ratio}, {radius}")
        if layers is not None and layers < 1:
            raise InvalidPromptError(f"{self.name} probe layers must be >= 1, got {layers}")
        self.ratio, self.radius, self.layers = ratio, radius, layers
        self.reset()

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        return cls(float(spec.value or 0.0), radius=0 if spec.option else 1, layers=spec.probe_layers)

    def reset(self) -> None:
        self.selected = torch.zeros(0, dtype=torch.bool)  # fused tokens picked for this request's plan
        self.probe_token_layers = 0
        self._prepared_for: FusionPlan | None = None

    def decisions(self) -> dict[str, Any]:
        return {**super().decisions(), "probe_token_layers": self.probe_token_layers, "selected": int(self.selected.sum())}

    def prepare(self, runner: ModelRunner, plan: FusionPlan, reused: ReusedKV | None = None) -> int:
        from engine_sidecar.execution.question_probe import probe_scores

        fused, budget = self._budget(plan)
        if budget >= int(fused.sum()) or budget <= 0:  # all or nothing: no scores needed
            self.selected = fused if budget > 0 else torch.zeros_like(fused)
            return 0
        scores, self.probe_token_layers = probe_scores(runner, plan, self.layers, reused)
        self.selected = self._top(scores, fused, budget, plan)
        return self.probe_token_layers

    def _budget(self, plan: FusionPlan) -> tuple[torch.Tensor, int]:
        """(fused mask, fused tokens to recompute), and this plan marked as prepared."""
        fused = span_masks(plan)[0]
        self._prepared_for, self.probe_token_layers = plan, 0
        return fused, min(math.ceil(self.ratio * int(fused.sum()) - 1e-9), int(fused.sum()))

    def _top(self, scores: torch.Tensor, fused: torch.Tensor, budget: int, plan: FusionPlan) -> torch.Tensor:
        from engine_sidecar.execution.question_probe import select_with_windows

        segments = [(s.start, s.end) for s in plan.spans if s.mode == "fuse"]
        return select_with_windows(scores, fused, budget, self.radius, segments)

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
        if self._prepared_for is not plan:
            raise AssertionError("prophet: prepare(runner, plan) must run before initial_active (fused_prefill does)")
        return span_masks(plan)[1] | self.selected


class GatePolicy(ProphetPolicy):
    """Confidence-gated budget: the prophet probe runs the question over the reused
    KV through every layer and, for the last prompt token, on to the next-token distribution,
    which is exactly what `reuse` would answer first. Where that prediction is confident
    (p(top 1) - p(top 2) >= `threshold`) nothing is recomputed (plain reuse); otherwise the
    top-ratio fused tokens by the probe's scores, with windows, are recomputed as under
    `prophet:ratio`. The cost therefore varies per request: the probe always, the budget only
    where the margin is small. At ratio 1 every fused token is recomputed and no probe runs."""

    name = "gate"
    # p(top 1) - p(top 2) at or above which reuse's first token is trusted
    threshold = 0.5

    def __init__(self, ratio: float = 0.3, radius: int = 1, threshold: float | None = None):
        super().__init__(ratio, radius)
        if threshold is not None:
            if not math.isfinite(threshold):
                raise InvalidPromptError(f"gate threshold must be a finite number, got {threshold}")
            self.threshold = threshold

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        return cls(float(spec.value or 0.0))

    def reset(self) -> None:
        super().reset()
        self.escalated = False  # this request's budget was spent (margin below the threshold)
        self.margin = math.nan  # its first-token margin under reuse (nan: no probe ran)

    def decisions(self) -> dict[str, Any]:
        return {**super().decisions(), "escalated": self.escalated,
                "margin": None if math.isnan(self.margin) else self.margin}

    def prepare(self, runner: ModelRunner, plan: FusionPlan, reused: ReusedKV | None = None) -> int:
        from engine_sidecar.execution.question_probe import first_token_margin, probe

        fused, budget = self._budget(plan)
        self.margin = math.nan
        if budget >= int(fused.sum()) or budget <= 0:  # all or nothing: no decision to make
            self.escalated = budget > 0
            self.selected = fused if budget > 0 else torch.zeros_like(fused)
            return 0
        result = probe(runner, plan, logits=True, reused=reused)
        self.probe_token_layers = result.token_layers
        if result.logits is not None:
            self.margin = first_token_margin(result.logits)
        # no prediction (nan) is no confidence: spend the budget
        self.escalated = not self.margin >= self.threshold
        if self.escalated:
            self.selected = self._top(result.scores, fused, budget, plan)
            plan.notes.append(f"gate: first-token margin {self.margin:.3f} < {self.threshold:g}: "
                              f"top {self.ratio:g} of the fused tokens recomputed")
        else:
            self.selected = torch.zeros_like(fused)
            plan.notes.append(f"gate: first-token margin {self.margin:.3f} >= {self.threshold:g}: reused as is")
        return self.probe_token_layers
