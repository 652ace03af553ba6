"""The policy interface. A Policy is a frozen spec, parsed once and shared by every request that
names it: it declares how planning treats its cached KV (`cache_use`) and, per request,
`select(view)` returns a Selection, the request's own record of which tokens get hidden states
from layer 0 (`initial`) and, after a layer's q/k/v projections, which of those keep being
recomputed (`refine`). Active sets only shrink, because a dropped token has no hidden state to
come back with. Tokens of `fresh` spans (no cache) and the question are always kept.

Nothing a request decides is written on the spec: two requests, or two threads, with one Policy
object never see each other's picks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine_sidecar.execution.plan import FusionPlan

if TYPE_CHECKING:
    from engine_sidecar.execution.question_probe import ReusedKV
    from engine_sidecar.model.runner import ModelRunner
    from ragcache_integrations.policy_registry import PolicySpec


@dataclass
class KeptRows:
    """A `refine` answer whose size the policy knows on the host: the executor then takes the rows
    without reading the mask's count back from the device (a host sync mid-prefill, which stops
    the host queueing the later layers while the device catches up)."""

    mask: torch.Tensor  # [A] bool
    count: int  # how many of it are True


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
    must_keep_count: int | None = None  # how many rows `must_keep` marks, known on the host

    # gathered only for the policies that read them (most layers of most policies do not)
    @cached_property
    def cached_keys(self) -> torch.Tensor:
        """[A, Hkv, D] cached keys of the active tokens (meaningless where must_keep)."""
        return self.all_keys_pre[self.active]

    @cached_property
    def cached_values(self) -> torch.Tensor:
        return self.all_values[self.active]


# (what one layer's selection sees) -> the rows to keep (a mask, or the mask with its count), or
# None to keep them all
Refine = Callable[[LayerView], "torch.Tensor | KeptRows | None"]


@dataclass(frozen=True)
class PrefillView:
    """What a policy selects from, before layer 0: the model, the plan, and the prefill's KV
    buffer with the cached KV rotated in place (None where it arrives layer by layer from disk;
    a question probe then reads the plan's entries)."""

    runner: ModelRunner
    plan: FusionPlan
    reused: ReusedKV | None = None


@dataclass
class Selection:
    """One request's selection, made by its policy's `select`: plain data the prefill reads, plus
    the per-layer choice where the policy makes one."""

    initial: torch.Tensor  # [T] bool: tokens with hidden states from layer 0 (every fresh one)
    # the initial tokens stay active on every layer, so their cached rows are never read and a
    # chunk on disk can be loaded without them (sparse load)
    fixed: bool = False
    refine: Refine | None = None  # per layer: which active tokens keep being recomputed
    # the last layer on which `refine` may drop rows; later layers compute a fixed set, which a
    # CUDA graph can replay. None with a `refine`: it may drop rows on any layer
    last_refine_layer: int | None = None
    token_layers: int = 0  # model work spent selecting (a question probe): counts as computed
    decided: dict[str, Any] = field(default_factory=dict)  # what it decided, plain values for stats

    def refines_until(self, num_layers: int) -> int:
        """The last layer whose `refine` may change the rows (-1: none does)."""
        if self.refine is None:
            return -1
        return num_layers - 1 if self.last_refine_layer is None else self.last_refine_layer


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


@dataclass(frozen=True)
class VariantChoice:
    """Cache-Craft's planning: each fused chunk takes its lowest-CFO variant among those recorded
    inside requests (CFO scaled by `alpha`); at `fresh_above` or more the chunk is computed in the
    request's context instead and kept as another variant."""

    alpha: float
    fresh_above: float


@dataclass(frozen=True)
class CacheUse:
    """How planning treats a policy's cached KV: what the planner and the reuse cache read of a
    policy, declared in one place."""

    lookup: bool = True  # looks up cached KV at all (full prefill does not)
    fuses: bool = True  # places cached chunk KV at new positions (else exact prefixes only)
    # Cache-Craft: planning picks among a chunk's recorded variants instead of its in-context entry,
    # and a variant is never promoted to a CP-Tree node
    variants: VariantChoice | None = None
    # the selection reads every cached layer before layer 0 (a question probe): KV on disk is read
    # whole while planning, not layer by layer during the prefill
    reads_all_layers_first: bool = False


@dataclass(frozen=True)
class Policy:
    """A selection policy's spec: its arguments, and (for every policy) `temperature`, `tempT`
    (APE): queries' logits on the cached keys of fused chunks are divided by it; the executor
    scales those rows of the rotated keys (recomputed rows and exact prefixes keep theirs).
    `temper_neighbour_kv` is False when T is the model's calibrated one rather than the spec's own
    tempT: fitted on KV computed alone, it made KV warmed after neighbours worse on both QA sets
    (docs/benchmarks.md), so it is left off there (KV computed in place keeps it: there the sets
    disagreed). A subclass is a frozen dataclass too, with a `name`."""

    name: ClassVar[str] = "policy"
    temperature: float = field(default=1.0, kw_only=True)
    temper_neighbour_kv: bool = field(default=True, kw_only=True)

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        """The policy a checked spec names (its argument, option and tags); a policy without
        arguments needs no override."""
        return cls()

    def cache_use(self) -> CacheUse:
        """How planning treats this policy's cached KV (most: fused chunks, read lazily)."""
        return CacheUse()

    def select(self, view: PrefillView) -> Selection:
        """This request's selection. The default recomputes the fresh tokens only."""
        return Selection(span_masks(view.plan)[1])

    def final_refine_layer(self, num_layers: int) -> int:
        """The last layer on which this policy's selections may drop rows (-1: none does)."""
        return -1

    def tempered(self, temperature: float, neighbour_kv: bool = True) -> Policy:
        """The same spec with attention temperature T."""
        return dataclasses.replace(self, temperature=temperature, temper_neighbour_kv=neighbour_kv)


@dataclass(frozen=True)
class RatioPolicy(Policy):
    """A policy with a recompute share `ratio`; under `<policy>:auto` (`auto`) the reuse cache sets
    it per request from measured costs (costs.py) with `at_ratio`, and the request's stats say
    which it took."""

    ratio: float = 0.15
    auto: bool = field(default=False, kw_only=True)

    def at_ratio(self, ratio: float) -> RatioPolicy:
        """This spec with recompute share `ratio` (an `:auto` request's)."""
        return dataclasses.replace(self, ratio=ratio)

    def decided(self) -> dict[str, Any]:
        """The ratio an `:auto` request ran with, for its stats."""
        return {"ratio": self.ratio} if self.auto else {}
