"""Selection at a check layer: CacheBlend (KV deviation), focus (the question's attention there)
and mix (deviation and a question probe together)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.policies.base import (
    CacheUse,
    KeptRows,
    LayerView,
    PrefillView,
    RatioPolicy,
    Selection,
    span_masks,
)
from ragcache_integrations.policy_registry import PolicySpec


@dataclass(frozen=True)
class CheckLayerPolicy(RatioPolicy):
    """Every fused token is computed up to the check layer; there the policy keeps the top-r of
    them (by its own score) and the rest fall back to their cached KV."""

    check_layer: int = field(default=1, kw_only=True)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise InvalidPromptError(f"{self.name} ratio must be in [0, 1], got {self.ratio}")

    def final_refine_layer(self, num_layers: int) -> int:
        return -1 if self.ratio >= 1.0 else self.check_layer

    def select(self, view: PrefillView) -> Selection:
        fused, fresh = span_masks(view.plan)
        return Selection(fused | fresh, refine=functools.partial(self.refine, int(fused.sum())),
                         last_refine_layer=self.final_refine_layer(view.runner.num_layers), decided=self.decided())

    def refine(self, fused_total: int, view: LayerView) -> torch.Tensor | KeptRows | None:
        """The rows kept on `view`'s layer, given the request's `fused_total` fused tokens."""
        raise NotImplementedError


@dataclass(frozen=True)
class CacheBlendPolicy(CheckLayerPolicy):
    """CacheBlend: all fused tokens computed up to the check layer; there the top-r tokens by
    value deviation (recomputed vs cached) are kept and the rest fall back to their cached KV.
    With gradual filtering, the kept share shrinks from `start_ratio` to r over a few layers.
    `min_tokens` keeps at least that many fused tokens (all of them when fewer), whatever r gives."""

    name = "cacheblend"
    gradual: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_tokens < 0:
            raise InvalidPromptError(f"cacheblend min tokens must be >= 0, got {self.min_tokens}")

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> CacheBlendPolicy:
        return cls(float(spec.value or 0.0), gradual=spec.option, min_tokens=spec.min_tokens, auto=spec.auto)

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

    def refine(self, fused_total: int, view: LayerView) -> KeptRows | None:
        ratio = self._target_ratio(view.layer, view.num_layers)
        if ratio is None or ratio >= 1.0:
            return None
        budget = max(math.ceil(ratio * fused_total), self.min_tokens)
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


@dataclass(frozen=True)
class FocusPolicy(CheckLayerPolicy):
    """Question-guided selection: at the check layer the tokens that must be computed (question,
    fresh chunks) attend over the fused tokens' keys; the top-r fused tokens by attention mass
    received are recomputed on later layers. It spends the budget on what the answer reads,
    rather than on what changed most."""

    name = "focus"

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> FocusPolicy:
        return cls(float(spec.value or 0.0))

    def refine(self, fused_total: int, view: LayerView) -> torch.Tensor | None:
        if view.layer != self.check_layer or self.ratio >= 1.0:
            return None
        assert view.new_queries is not None and view.rope is not None
        readers = view.must_keep
        candidates = ~view.must_keep
        budget = min(math.ceil(self.ratio * fused_total), int(candidates.sum()))
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


@dataclass(frozen=True)
class MixPolicy(CheckLayerPolicy):
    """Union of CacheBlend's and prophet's signals (`engine_sidecar.execution.mix`): before layer 0
    the question probe scores each fused token by the question's attention over the reused KV
    (every layer, no windows); as under CacheBlend every fused token is computed up to the check
    layer, where the top-r tokens by the rank-average of that score and the KV deviation (`rank`),
    or half the budget by each (`split`), keep being recomputed. Cost: CacheBlend's plus the probe;
    `layers` stops the probe after the first L layers. At r = 1 every fused token is recomputed on
    every layer (full prefill) and no probe runs."""

    name = "mix"
    mode: str = "rank"
    layers: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("rank", "split"):
            raise InvalidPromptError(f"mix mode must be 'rank' or 'split', got {self.mode!r}")
        if self.layers is not None and self.layers < 1:
            raise InvalidPromptError(f"mix probe layers must be >= 1, got {self.layers}")

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> MixPolicy:
        return cls(float(spec.value or 0.0), mode="split" if spec.option else "rank", layers=spec.probe_layers)

    def cache_use(self) -> CacheUse:
        return CacheUse(reads_all_layers_first=True)  # the probe reads every cached layer before layer 0

    def select(self, view: PrefillView) -> Selection:
        from engine_sidecar.execution.question_probe import probe_scores

        plan = view.plan
        fused, fresh = span_masks(plan)
        fused_total = int(fused.sum())
        scores, work = torch.zeros(plan.num_tokens), 0
        budget = math.ceil(self.ratio * fused_total)
        if self.ratio < 1.0 and 0 < budget < fused_total:  # else nothing to choose: no probe
            scores, work = probe_scores(view.runner, plan, self.layers, view.reused)
        return Selection(fused | fresh, refine=functools.partial(self.refine_mixed, fused_total, scores),
                         last_refine_layer=self.final_refine_layer(view.runner.num_layers), token_layers=work,
                         decided={**self.decided(), "probe_token_layers": work})

    def refine_mixed(self, fused_total: int, question_scores: torch.Tensor, view: LayerView) -> torch.Tensor | None:
        """The check layer's rows, given the probe's `question_scores` [T] (zeros when not probed)."""
        from engine_sidecar.execution.mix import select_mixed

        if view.layer != self.check_layer or self.ratio >= 1.0:
            return None
        candidates = ~view.must_keep
        deviation = (view.new_values - view.cached_values).float().pow(2).sum(dim=(1, 2))
        question = question_scores[view.active.cpu()]
        chosen = select_mixed(question, deviation, candidates, math.ceil(self.ratio * fused_total), self.mode)
        return view.must_keep | chosen.to(view.must_keep.device)
