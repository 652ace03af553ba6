"""Token-selection policies for fused prefill: one module per family behind the interface in
`base`, built from their specs by `registry`."""

from engine_sidecar.execution.policies.base import (
    CacheUse,
    KeptRows,
    LayerView,
    Policy,
    PrefillView,
    RatioPolicy,
    Selection,
    VariantChoice,
    span_masks,
)
from engine_sidecar.execution.policies.cacheblend import CacheBlendPolicy, FocusPolicy, MixPolicy
from engine_sidecar.execution.policies.cachecraft import CacheCraftPolicy
from engine_sidecar.execution.policies.cachetune import CacheTunePolicy
from engine_sidecar.execution.policies.plain import EpicPolicy, FullPolicy, PrefixPolicy, ReusePolicy
from engine_sidecar.execution.policies.prophet import GatePolicy, ProphetPolicy
from engine_sidecar.execution.policies.registry import parse_policy, register_policy
from engine_sidecar.store.frequency import frequency_scores

__all__ = ["CacheBlendPolicy", "CacheCraftPolicy", "CacheTunePolicy", "CacheUse", "EpicPolicy", "FocusPolicy",
           "FullPolicy", "GatePolicy", "KeptRows", "LayerView", "MixPolicy", "Policy", "PrefillView", "PrefixPolicy",
           "ProphetPolicy", "RatioPolicy", "ReusePolicy", "Selection", "VariantChoice", "frequency_scores",
           "parse_policy", "register_policy", "span_masks"]
