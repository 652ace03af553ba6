"""Policy specs and chunk-KV modes `ragcache bench fidelity` accepts: the registry's policies,
plus the bench-only `oracle:<ratio>` (ragcache_lab/oracle_policy.py). No torch here: the
CLI checks `--policies` and `--chunk-kv` while it builds its parser."""

from __future__ import annotations

import argparse

from engine_sidecar.errors import InvalidPromptError
from ragcache_integrations.policy_registry import DEFAULT_POLICY, parse_policy_spec, policy_arg

ORACLE = "oracle"


# the strongest question-driven selectors (docs/benchmarks.md, "mix" section): shown by default so
# one `bench fidelity` command puts them beside the baseline they have to beat
STRONGEST_NEW = ("prophet:0.15:nowindow", "mix:0.15:split")

# the published CacheBlend at 15%: no attention temperature, whatever the engine has fitted
BASELINE = "cacheblend:0.15:temp1"


def default_fidelity_policies(default: str = DEFAULT_POLICY) -> str:
    """`bench fidelity`'s --policies when none are given: full, reuse, the untempered CacheBlend
    baseline, the engine's default policy (with the model's calibrated temperature, if any) and the
    strongest new ones, each once (a bare name is its registry default, so 'epic' and 'epic:16' are
    one policy), in that order."""
    specs: list[str] = []
    for spec in ("full", "reuse", BASELINE, default, *STRONGEST_NEW):
        if all(parse_policy_spec(spec) != parse_policy_spec(other) for other in specs):
            specs.append(spec)
    return ",".join(specs)


def is_oracle(spec: str) -> bool:
    return spec.strip().split(":", 1)[0] == ORACLE


def oracle_ratio(spec: str) -> float:
    """The ratio of 'oracle:<ratio>' (in [0, 1])."""
    name, _, value = spec.strip().partition(":")
    if name != ORACLE:
        raise InvalidPromptError(f"not an oracle policy: {spec!r}")
    try:
        ratio = float(value)
    except ValueError:
        raise InvalidPromptError(f"oracle needs a ratio in [0, 1], as in oracle:0.15 (got {spec!r})") from None
    if not 0.0 <= ratio <= 1.0:
        raise InvalidPromptError(f"oracle ratio must be in [0, 1], got {ratio}")
    return ratio


def fidelity_policy_list_arg(text: str) -> str:
    """argparse `type=` for `bench fidelity --policies`: registry policies and oracle:<ratio>."""
    for spec in (s.strip() for s in text.split(",")):
        if not spec:
            continue
        if is_oracle(spec):
            try:
                oracle_ratio(spec)
            except InvalidPromptError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        else:
            policy_arg(spec)
    return text


ORACLE_HELP = ("; bench only: oracle:<ratio> recomputes the fused tokens whose reused KV differs most from full "
               "prefill's (needs full prefill's KV of the same prompt: a reference point, not a deployable policy)")


# where a run's reused chunk KV comes from (`bench fidelity --chunk-kv`)
CHUNK_KV_MODES = ("precomputed", "in-context", "neighbours")
# KV computed alone and KV warmed after neighbours, paired: the best measured combination (the
# default policy on neighbour-warmed KV) beside CacheBlend at 15% on KV computed alone
DEFAULT_CHUNK_KV = ("precomputed", "neighbours")


def chunk_kv_list_arg(text: str) -> list[str]:
    """argparse `type=` for `bench fidelity --chunk-kv`: one mode, or several to pair."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in CHUNK_KV_MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(CHUNK_KV_MODES)}, comma-separated")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"{text!r}: a mode is named twice")
    return modes
