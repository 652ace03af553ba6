"""The policy interface: which tokens get hidden states from layer 0 (`initial_active`) and, after
a layer's q/k/v projections, which of those keep being recomputed (`refine`). Active sets only
shrink, because a dropped token has no hidden state to come back with. Tokens of `fresh` spans
(no cache) and the question are always kept.

A Policy object is a spec; `for_request` gives the copy one request selects with, so per-request
state (picks, probe counts, an `:auto` ratio) never outlives its request or leaks between two."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

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

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> Policy:
        """The policy a checked spec names (its argument, option and tags); a policy without
        arguments needs no override."""
        return cls()

    def initial_active(self, plan: FusionPlan) -> torch.Tensor:
        """Bool mask [T]; must include every fresh token."""
        return span_masks(plan)[1]

    def refine(self, view: LayerView) -> torch.Tensor | KeptRows | None:
        """Bool mask [A] of tokens to keep (or KeptRows, the mask with its count), or None to keep all."""
        return None

    def final_refine_layer(self, num_layers: int) -> int:
        """The last layer whose `refine` may change the rows (-1: none ever does). Later layers
        compute a fixed set of rows, which a CUDA graph can replay. A policy that overrides
        `refine` without saying where it stops is taken to refine on every layer."""
        return -1 if type(self).refine is Policy.refine else num_layers - 1

    def prepare(self, runner: ModelRunner, plan: FusionPlan, reused: ReusedKV | None = None) -> int:
        """Work with the model before layer 0 (prophet's question probe); returns the
        token-layers it computed, which count in the request's computed share. Most: none.
        `reused` is the prefill's KV buffer with the cached KV in place (None where it is read
        layer by layer during the prefill): the probe reads it instead of its own copy."""
        return 0

    def for_request(self) -> Policy:
        """The copy of this spec one request selects with: its picks, probe counts and `:auto`
        ratio stay on the copy, so the spec a caller holds (or passes again, or from two threads)
        never carries another request's state."""
        fresh = copy.copy(self)
        fresh.reset()
        return fresh

    def reset(self) -> None:
        """Clear what one request's selection left behind (subclasses with state extend this)."""

    def decisions(self) -> dict[str, Any]:
        """What this request's selection decided, as plain values for its stats."""
        return {"ratio": self.ratio} if self.auto else {}
