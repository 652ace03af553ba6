"""Selection at a check layer: CacheBlend (KV deviation), focus (the question's attention there)
and mix (deviation and a question probe together)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.policies.base import KeptRows, LayerView, Policy, span_masks
from ragcache_integrations.policy_registry import PolicySpec

if TYPE_CHECKING:
    from engine_sidecar.execution.question_probe import ReusedKV
    from engine_sidecar.model.runner import ModelRunner


class CacheBlendPolicy(Policy):
    """CacheBlend: all fused tokens computed up to the check layer; there the top-r tokens by
    value deviation (recomputed vs cached) are kept and the rest fall back to their cached KV.
    With gradual filtering, the kept share shrinks from `start_ratio` to r over a few layers.
    `min_tokens` keeps at least that many fused tokens (all of them when fewer), whatever r gives."""

    name = "cacheblend"

    def __init__(self, ratio: float = 0.15, check_layer: int = 1, gradual: bool = False, min_tokens: int = 0):
        if not 0.0 <= ratio <= 1.0:
            raise InvalidPromptError(f"cacheblend ratio must be in [0, 1], got {ratio}")
        if min_tokens < 0:
            raise InvalidPromptError(f"cacheblend min tokens must be >= 0, got {min_tokens}")
        self.ratio = ratio
        self.check_layer = check_layer
        self.gradual = gradual
        self.min_tokens = min_tokens
        self.reset()

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        blend = cls(float(spec.value or 0.0), gradual=spec.option, min_tokens=spec.min_tokens)
        blend.auto = spec.auto
        return blend

    def reset(self) -> None:
        self._fused_total = 0

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
        fused, fresh = span_masks(plan)
        self._fused_total = int(fused.sum())
        return fused | fresh

    def _target_ratio(self, layer: int, num_layers: int) -> float | None:
        if not self.gradual:
            return self.ratio if layer == self.check_layer else None
        # 3r, 2r, then r; on shallow models the last step is pulled in so r is always reached
        last = min(self.check_layer + 2, max(self.check_layer, num_layers - 1))
        if layer == last:
            return self.ratio
        offset = layer - self.check_layer
        return min(1.0, self.ratio * (3 - offset)) if 0 <= offset < last - self.check_layer else None

    def final_refine_layer(self, num_layers: int) -> int:
        if self.ratio >= 1.0:
            return -1
        if not self.gradual:
            return self.check_layer
        return max((layer for layer in range(num_layers) if self._target_ratio(layer, num_layers) is not None),
                   default=-1)

    def refine(self, view: LayerView) -> KeptRows | None:
        ratio = self._target_ratio(view.layer, view.num_layers)
        if ratio is None or ratio >= 1.0:
            return None
        budget = max(math.ceil(ratio * self._fused_total), self.min_tokens)
        deviation = (view.new_values - view.cached_values).float().pow(2).sum(dim=(1, 2))
        deviation.masked_fill_(view.must_keep, -1.0)
        keep = view.must_keep.clone()
        # the count from the host where it knows it: reading it off the device is a sync
        kept_before = view.must_keep_count if view.must_keep_count is not None else int(view.must_keep.sum())
        budget = min(budget, int(view.active.shape[0]) - kept_before)
        if budget > 0:
            # a fill, not `keep[indices] = True`: that copies the True to the device first, a sync
            keep.index_fill_(0, torch.topk(deviation, budget).indices, True)
        return KeptRows(keep, kept_before + max(budget, 0))


class FocusPolicy(CacheBlendPolicy):
    """Question-guided selection: at the check layer the tokens that must be computed (question,
    fresh chunks) attend over the fused tokens' keys; the top-r fused tokens by attention mass
    received are recomputed on later layers. It spends the budget on what the answer reads,
    rather than on what changed most."""

    name = "focus"

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        return cls(float(spec.value or 0.0))

    def refine(self, view: LayerView) -> torch.Tensor | None:
        if view.layer != self.check_layer or self.ratio >= 1.0:
            return None
        assert view.new_queries is not None and view.rope is not None
        readers = view.must_keep
        candidates = ~view.must_keep
        budget = min(math.ceil(self.ratio * self._fused_total), int(candidates.sum()))
        keep = view.must_keep.clone()
        if budget <= 0 or not bool(readers.any()):
            return keep
        q = view.rope(view.new_queries[readers], view.active[readers]).float()  # [R, H, D]
        k = view.rope(view.new_keys, view.active).float()  # [A, Hkv, D]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = torch.einsum("rhd,ahd->hra", q, k) / math.sqrt(q.shape[-1])
        visible = view.active[None, :] <= view.active[readers][:, None]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        mass = probs.mean(dim=(0, 1))
        mass[~candidates] = -1.0
        keep[torch.topk(mass, budget).indices] = True
        return keep


class MixPolicy(CacheBlendPolicy):
    """Union of CacheBlend's and prophet's signals (`engine_sidecar.execution.mix`): before layer 0 the
    prophet probe scores each fused token by the question's attention over the reused KV (every
    layer, no windows); as under CacheBlend every fused token is computed up to the check layer,
    where the top-r tokens by the rank-average of that score and the KV deviation (`rank`), or half
    the budget by each (`split`), keep being recomputed. Cost: CacheBlend's plus the probe; `layers`
    stops the probe after the first L layers. At r = 1 every fused token is recomputed on every
    layer (full prefill) and no probe runs."""

    name = "mix"
    needs_cached_kv = True  # the probe reads every cached layer before layer 0

    def __init__(self, ratio: float = 0.15, mode: str = "rank", check_layer: int = 1, layers: int | None = None):
        super().__init__(ratio, check_layer)
        if mode not in ("rank", "split"):
            raise InvalidPromptError(f"mix mode must be 'rank' or 'split', got {mode!r}")
        if layers is not None and layers < 1:
            raise InvalidPromptError(f"mix probe layers must be >= 1, got {layers}")
        self.mode, self.layers = mode, layers
        self.reset()

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        return cls(float(spec.value or 0.0), mode="split" if spec.option else "rank", layers=spec.probe_layers)

    def reset(self) -> None:
        super().reset()
        self.question_scores = torch.zeros(0)  # [T] the probe's scores for this request's plan
        self.probe_token_layers = 0

    def decisions(self) -> dict[str, Any]:
        return {**super().decisions(), "probe_token_layers": self.probe_token_layers}

    def prepare(self, runner: ModelRunner, plan: FusionPlan, reused: ReusedKV | None = None) -> int:
        from engine_sidecar.execution.question_probe import probe_scores

        fused = span_masks(plan)[0]
        self.question_scores = torch.zeros(plan.num_tokens)
        self.probe_token_layers = 0
        budget = math.ceil(self.ratio * int(fused.sum()))
        if self.ratio >= 1.0 or budget <= 0 or budget >= int(fused.sum()):  # nothing to choose
            return 0
        self.question_scores, self.probe_token_layers = probe_scores(runner, plan, self.layers, reused)
        return self.probe_token_layers

    def refine(self, view: LayerView) -> torch.Tensor | None:
        from engine_sidecar.execution.mix import select_mixed

        if view.layer != self.check_layer or self.ratio >= 1.0:
            return None
        candidates = ~view.must_keep
        deviation = (view.new_values - view.cached_values).float().pow(2).sum(dim=(1, 2))
        question = self.question_scores[view.active.cpu()]  # [T] after prepare (zeros when not probed)
        chosen = select_mixed(question, deviation, candidates, math.ceil(self.ratio * self._fused_total), self.mode)
        return view.must_keep | chosen.to(view.must_keep.device)
