"""Policy specs ('cacheblend:0.3:gradual', 'prophet:0.15:nowindow', ...) to Policy objects: each
policy's class builds itself from its checked spec (`Policy.from_spec`). A built-in policy is its
module, its grammar entry in `ragcache_integrations.policy_registry` (which clients read without
torch) and its class in `POLICY_CLASSES`; from outside the package, one `register_policy` call."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.policies.base import Policy
from engine_sidecar.execution.policies.cacheblend import CacheBlendPolicy, FocusPolicy, MixPolicy
from engine_sidecar.execution.policies.cachecraft import CacheCraftPolicy
from engine_sidecar.execution.policies.cachetune import CacheTunePolicy
from engine_sidecar.execution.policies.plain import EpicPolicy, FullPolicy, PrefixPolicy, ReusePolicy
from engine_sidecar.execution.policies.prophet import GatePolicy, ProphetPolicy
from ragcache_integrations.policy_registry import (
    PolicyEntry,
    PolicySpec,
    PolicySpecError,
    add_policy_entry,
    parse_policy_spec,
)


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
        return policy.tempered(parsed.temperature)
    if temperatures and parsed.name in temperatures:
        return policy.tempered(temperatures[parsed.name], neighbour_kv=False)
    return policy


def _policy_of(parsed: PolicySpec) -> Policy:
    cls = POLICY_CLASSES.get(parsed.name)
    if cls is None:  # a grammar entry without a class is a bug, not a user error
        raise NotImplementedError(f"policy '{parsed.name}' is in the grammar but has no Policy class")
    return cls.from_spec(parsed)


# the class that runs each policy of the grammar, by its name
POLICY_CLASSES: dict[str, type[Policy]] = {cls.name: cls for cls in (
    FullPolicy, PrefixPolicy, ReusePolicy, CacheBlendPolicy, FocusPolicy, ProphetPolicy, MixPolicy, GatePolicy,
    EpicPolicy, CacheTunePolicy, CacheCraftPolicy)}


def register_policy(entry: PolicyEntry, cls: type[Policy]) -> Callable[[], None]:
    """Add a policy: its grammar entry (name, argument, tags, summary) and the class that runs it, a
    frozen dataclass (`cls.from_spec` builds it from a checked spec). From then on this process's
    engine, server and CLI accept it like a built-in one. Returns the function that removes it."""
    if cls.name != entry.name:
        raise ValueError(f"the class's name '{cls.name}' differs from the entry's '{entry.name}'")
    if entry.name in POLICY_CLASSES:
        raise ValueError(f"policy '{entry.name}' is already registered")
    if "__dataclass_fields__" not in vars(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise ValueError(f"policy class {cls.__name__} must be a @dataclass(frozen=True): a spec that one "
                         "request could change would leak into the next")
    remove_entry = add_policy_entry(entry)
    POLICY_CLASSES[entry.name] = cls

    def unregister() -> None:
        remove_entry()
        if POLICY_CLASSES.get(entry.name) is cls:
            del POLICY_CLASSES[entry.name]

    return unregister
