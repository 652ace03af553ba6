"""Token-selection policies for fused prefill, behind one small interface.

A policy answers two questions for the executor: which tokens get hidden states from layer 0
(`initial_active`), and, after a layer's q/k/v projections, which of those tokens keep being
recomputed (`refine`). Active sets only shrink, because a dropped token has no hidden state to
come back with. Tokens of `fresh` spans (no cache) and the question are always kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.store.frequency import DEFAULT_CUTOFF, frequency_scores
from ragcache_integrations.policy_registry import PolicySpec, PolicySpecError, parse_policy_spec

if TYPE_CHECKING:
    from engine_sidecar.execution.prophet import ReusedKV
    from engine_sidecar.model.runner import ModelRunner


@dataclass
class LayerView:
    layer: int
    active: torch.Tensor  # [A] global token indices with hidden states, ascending
    must_keep: torch.Tensor  # [A] bool: tokens that cannot be dropped (fresh spans, question)
    new_keys: torch.Tensor  # [A, Hkv, D] recomputed, before RoPE
    new_values: torch.Tensor
    # [T, Hkv, D] pre-RoPE keys and values of every prompt token as the buffer holds them before
    # this layer's update (cached where not active; rows of active tokens are stale)
    all_keys_pre: torch.Tensor
    all_values: torch.Tensor
    num_layers: int = 0
    new_queries: torch.Tensor | None = None  # [A, H, D] before RoPE
    rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (x, global idx) -> rotated

    # gathered only for the policies that read them (most layers of most policies do not)
    @cached_property
    def cached_keys(self) -> torch.Tensor:
        """[A, Hkv, D] cached keys of the active tokens (meaningless where must_keep)."""
        return self.all_keys_pre[self.active]

    @cached_property
    def cached_values(self) -> torch.Tensor:
        return self.all_values[self.active]


def span_masks(plan: FusionPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused, fresh) boolean masks over all prompt tokens."""
    fused = torch.zeros(plan.num_tokens, dtype=torch.bool)
    fresh = torch.zeros(plan.num_tokens, dtype=torch.bool)
    for span in plan.spans:
        if span.mode == "fuse":
            fused[span.start : span.end] = True
        elif span.mode == "fresh":
            fresh[span.start : span.end] = True
    return fused, fresh


class Policy:
    name = "policy"
    uses_cache = True  # looks up cached KV at all
    fuses = True  # places cached chunk KV at new positions (else only exact prefix reuse)
    # the recompute share, for the policies that have one; under `<policy>:auto` the engine sets it
    # per request from measured costs (costs.py)
    ratio = 1.0
    auto = False
    # keeps chunk variants recorded inside requests (Cache-Craft): planning picks among a chunk's
    # variants instead of its in-context entry, and a variant is never promoted to a CP-Tree node
    records_variants = False
    needs_cached_kv = False  # reads every cached layer before layer 0 (no layer-wise prefetch)
    # the layer-0 active set is never shrunk by `refine`: cached rows of those tokens are never
    # read, so a chunk on disk can be loaded without them (sparse load)
    keeps_initial_active = False
    # `tempT` (APE): queries' logits on the cached keys of fused chunks are divided by this; the
    # executor scales those rows of the rotated keys (recomputed rows and exact prefixes keep theirs)
    temperature = 1.0
    # False when T is the model's calibrated one (not the spec's own tempT): fitted on KV computed
    # alone, it made KV warmed after neighbours worse on both QA sets (docs/benchmarks.md), so it
    # is left off there (KV computed in place keeps it: there the sets disagreed)
    temper_neighbour_kv = True

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
        """Bool mask [T]; must include every fresh token."""
        return span_masks(plan)[1]

    def refine(self, view: LayerView) -> torch.Tensor | None:
        """Bool mask [A] of tokens to keep, or None to keep all."""
        return None

    def prepare(self, runner: ModelRunner, plan: FusionPlan, reused: ReusedKV | None = None) -> int:
        """Work with the model before layer 0 (prophet's question probe); returns the
        token-layers it computed, which count in the request's computed share. Most: none.
        `reused` is the prefill's KV buffer with the cached KV in place (None where it is read
        layer by layer during the prefill): the probe reads it instead of its own copy."""
        return 0


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

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
        active = span_masks(plan)[1]
        for span in plan.spans:
            if span.mode == "fuse":
                active[span.start : span.start + min(self.k, len(span))] = True
        return active


class CacheTunePolicy(Policy):
    """CacheTune: recompute, from layer 0, the top-r tokens of each fused chunk by frequency score
    (`frequency_scores` of its cached K/V, stored with the chunk on the disk tier); the rest keep
    their cached KV. The chosen tokens stay chosen on every layer, so a chunk read from disk needs
    only the other tokens' rows (sparse load)."""

    name = "cachetune"
    keeps_initial_active = True

    def __init__(self, ratio: float = 0.15, cutoff: float = DEFAULT_CUTOFF):
        if not 0.0 <= ratio <= 1.0 or not 0.0 < cutoff <= 1.0:
            raise ValueError("ratio must be in [0, 1] and cutoff in (0, 1]")
        self.ratio, self.cutoff = ratio, cutoff

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
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
        return active


class CacheBlendPolicy(Policy):
    """CacheBlend: all fused tokens computed up to the check layer; there the top-r tokens by
    value deviation (recomputed vs cached) are kept and the rest fall back to their cached KV.
    With gradual filtering, the kept share shrinks from `start_ratio` to r over a few layers."""

    name = "cacheblend"

    def __init__(self, ratio: float = 0.15, check_layer: int = 1, gradual: bool = False):
        if not 0.0 <= ratio <= 1.0:
            raise InvalidPromptError(f"cacheblend ratio must be in [0, 1], got {ratio}")
        self.ratio = ratio
        self.check_layer = check_layer
        self.gradual = gradual
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

    def refine(self, view: LayerView) -> torch.Tensor | None:
        ratio = self._target_ratio(view.layer, view.num_layers)
        if ratio is None or ratio >= 1.0:
            return None
        candidates = ~view.must_keep
        budget = math.ceil(ratio * self._fused_total)
        deviation = (view.new_values - view.cached_values).float().pow(2).sum(dim=(1, 2))
        deviation[~candidates] = -1.0
        keep = view.must_keep.clone()
        budget = min(budget, int(candidates.sum()))
        if budget > 0:
            keep[torch.topk(deviation, budget).indices] = True
        return keep


class FocusPolicy(CacheBlendPolicy):
    """Question-guided selection: at the check layer the tokens that must be computed (question,
    fresh chunks) attend over the fused tokens' keys; the top-r fused tokens by attention mass
    received are recomputed on later layers. It spends the budget on what the answer reads,
    rather than on what changed most."""

    name = "focus"

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
        self.stopped_at: int | None = None
        self._question = torch.zeros(0, dtype=torch.bool)
        self._chunks: list[tuple[int, int]] = []
        self._history: list[frozenset[int]] = []

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
        self.question_scores = torch.zeros(0)  # [T] the probe's scores for the last prepared plan
        self.probe_token_layers = 0

    def prepare(self, runner: ModelRunner, plan: FusionPlan, reused: ReusedKV | None = None) -> int:
        from engine_sidecar.execution.prophet import probe_scores

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
        self.selected = torch.zeros(0, dtype=torch.bool)  # fused tokens picked for the last plan
        self.probe_token_layers = 0
        self._prepared_for: FusionPlan | None = None

    def prepare(self, runner: ModelRunner, plan: FusionPlan, reused: ReusedKV | None = None) -> int:
        from engine_sidecar.execution.prophet import probe_scores

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
        from engine_sidecar.execution.prophet import select_with_windows

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
        self.escalated = False  # the last plan's budget was spent (margin below the threshold)
        self.margin = math.nan  # the last plan's first-token margin under reuse (nan: no probe ran)

    def prepare(self, runner: ModelRunner, plan: FusionPlan, reused: ReusedKV | None = None) -> int:
        from engine_sidecar.execution.prophet import first_token_margin, probe

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


def parse_policy(spec: str, temperatures: Mapping[str, float] | None = None) -> Policy:
    """A Policy from its spec ('cacheblend:0.3:gradual', 'epic:16', 'cachecraft:1:nostop', ...).
    `temperatures` (policy name -> T, the engine's calibrated ones) gives the attention
    temperature of a spec that names no tempT; a spec's own tempT always wins.

    The grammar, defaults and argument ranges live in `ragcache_integrations.policy_registry`, so
    the CLI, the HTTP API and this parser accept and reject exactly the same strings."""
    try:
        parsed = parse_policy_spec(spec)
    except PolicySpecError as exc:
        raise InvalidPromptError(str(exc)) from None
    policy = _policy_of(parsed)
    if parsed.temperature is not None:
        policy.temperature = parsed.temperature
    elif temperatures and parsed.name in temperatures:
        policy.temperature = temperatures[parsed.name]
        policy.temper_neighbour_kv = False
    return policy


def _policy_of(parsed: PolicySpec) -> Policy:
    value = parsed.value
    if parsed.name == "full":
        return FullPolicy()
    if parsed.name == "prefix":
        return PrefixPolicy()
    if parsed.name == "reuse":
        return ReusePolicy()
    if parsed.name == "cacheblend":
        blend = CacheBlendPolicy(float(value or 0.0), gradual=parsed.option)
        blend.auto = parsed.auto
        return blend
    if parsed.name == "focus":
        return FocusPolicy(float(value or 0.0))
    if parsed.name == "prophet":
        return ProphetPolicy(float(value or 0.0), radius=0 if parsed.option else 1, layers=parsed.probe_layers)
    if parsed.name == "mix":
        return MixPolicy(float(value or 0.0), mode="split" if parsed.option else "rank", layers=parsed.probe_layers)
    if parsed.name == "gate":
        return GatePolicy(float(value or 0.0))
    if parsed.name == "epic":
        return EpicPolicy(int(value or 0))
    if parsed.name == "cachetune":
        tune = CacheTunePolicy(float(value or 0.0))
        tune.auto = parsed.auto
        return tune
    if parsed.name == "cachecraft":
        return CacheCraftPolicy(float(value or 0.0), early_stop=not parsed.option)
    # a registry entry without a class here is a bug, not a user error
    raise NotImplementedError(f"policy '{parsed.name}' is in the registry but has no Policy class")
