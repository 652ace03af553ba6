"""Policy specs ('cacheblend:0.3:gradual', 'prophet:0.15:nowindow', ...) to Policy objects."""

from __future__ import annotations

from collections.abc import Mapping

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.policies.base import Policy
from engine_sidecar.execution.policies.cacheblend import CacheBlendPolicy, FocusPolicy, MixPolicy
from engine_sidecar.execution.policies.cachecraft import CacheCraftPolicy
from engine_sidecar.execution.policies.cachetune import CacheTunePolicy
from engine_sidecar.execution.policies.plain import EpicPolicy, FullPolicy, PrefixPolicy, ReusePolicy
from engine_sidecar.execution.policies.prophet import GatePolicy, ProphetPolicy
from ragcache_integrations.policy_registry import PolicySpec, PolicySpecError, parse_policy_spec


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
        blend = CacheBlendPolicy(float(value or 0.0), gradual=parsed.option, min_tokens=parsed.min_tokens)
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
