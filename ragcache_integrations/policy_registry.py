"""The recompute-policy grammar in one place: each policy's name, argument form and one-line summary.

The engine's `parse_policy`, the CLI's `--policy` help, the HTTP API's validation and the
adapters' field descriptions all read this table, so a policy added here is accepted, rejected
and documented the same way everywhere. Standard library only: the adapters import it, and they
must not pull torch.

A spec is `name[:argument[:tag]...]`: `cacheblend`, `cacheblend:0.3`, `cacheblend:auto:gradual`,
`epic:16`, `cachecraft:1:nostop`, `prophet:0.15:nowindow:probe8`, `cacheblend:0.15:temp1.1`,
`cacheblend:0.15:min32`. Every
field is non-empty and every number is plain ASCII (`0.15`, `1e-1`, `16`), within its range
(`ARG_RANGES`, `PROBE_RANGE`, `TEMP_RANGE`). A tag is the entry's one option word; for
the policies that run the question probe, `probeL` (the probe stops after the first L layers); for
every policy that fuses cached chunks, `tempT` (attention temperature T on the reused chunk KV, APE;
`reuse:temp1.1` for the policy without an argument); for CacheBlend, `minN` (at least N fused tokens
recomputed, however short the prompt); each at most once, in any order. Tags follow the argument,
or the name when the argument is left at its default (`cachecraft:temp20` = `cachecraft:1:temp20`):
an argument is a number or `auto`, so a tag never reads as one.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ArgKind = Literal["ratio", "k", "alpha"]

# each numeric field's range, inclusive: a client may send any string, and a value far outside
# what the engine can use (a probe deeper than any model, an attention temperature that turns
# logits into infinity) must be refused here, never reach the model
ARG_RANGES: dict[str, tuple[float, float]] = {
    "ratio": (0.0, 1.0),
    "k": (0, 65536),  # tokens per chunk: more than any chunk the server accepts
    "alpha": (0.0, 100.0),
}
PROBE_RANGE = (1, 1024)  # layers
MIN_RANGE = (0, 65536)  # fused tokens recomputed at least: more than any prompt the server accepts
TEMP_RANGE = (0.05, 20.0)  # attention temperature: a calibrated T is near 1; far outside, logits overflow

# what each argument kind accepts, said the same way in every error message
_ARG_RULES: dict[str, str] = {
    "ratio": "a number in [0, 1]",
    "k": f"a whole number in [0, {ARG_RANGES['k'][1]}]",
    "alpha": f"a number in [0, {ARG_RANGES['alpha'][1]:g}]",
}

# plain ASCII decimals only: float() and int() also take '٠.١', '1_0', ' 1', 'nan' and 'inf'
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", re.ASCII)
_WHOLE = re.compile(r"[0-9]+", re.ASCII)


class PolicySpecError(ValueError):
    """A policy string that does not follow the grammar; the message lists the valid forms."""


@dataclass(frozen=True)
class PolicyEntry:
    name: str
    summary: str
    arg: ArgKind | None = None
    default: float | int | None = None
    auto: bool = False  # 'auto' may stand in for the argument: the engine picks the ratio
    option: str | None = None  # the one word allowed after the argument
    probe: bool = False  # runs the question probe: `probeL` limits it to the first L layers
    tempers: bool = True  # fuses cached chunks, so `tempT` may set the attention temperature on them
    floor: bool = False  # a recompute share: `minN` sets the fused tokens recomputed at least

    @property
    def form(self) -> str:
        """The grammar of this entry, e.g. `cacheblend[:ratio|auto[:gradual][:minN]]`,
        `prophet[:ratio[:nowindow][:probeL]]`."""
        if self.arg is None:
            return self.name
        arg = f"{self.arg}|auto" if self.auto else self.arg
        option = f"[:{self.option}]" if self.option else ""
        probe = f"[:{PROBE_TAG}L]" if self.probe else ""
        floor = f"[:{MIN_TAG}N]" if self.floor else ""
        return f"{self.name}[:{arg}{option}{probe}{floor}]"

    @property
    def examples(self) -> tuple[str, ...]:
        """One spec per accepted shape: the bare name, the default spelled out, `auto`, the option."""
        specs = [self.name]
        if self.arg is not None:
            specs.append(f"{self.name}:{self.default}")
        if self.auto:
            specs.append(f"{self.name}:auto")
        if self.option:
            specs.append(f"{self.name}:{self.default}:{self.option}")
        if self.probe:
            specs.append(f"{self.name}:{self.default}:{self.option}:{PROBE_TAG}8" if self.option
                         else f"{self.name}:{self.default}:{PROBE_TAG}8")
        if self.floor:
            specs.append(f"{self.name}:{self.default}:{MIN_TAG}32")
        return tuple(specs)


# `probeL`: the question probe (prophet, mix) runs the first L layers only, so its cost is about
# L / depth of the whole probe's; whether the picks hold up is for `bench fidelity` to tell
PROBE_TAG = "probe"
# `tempT` (APE): logits of queries on the cached KV of fused chunks (not on exact prefixes, not on
# recomputed tokens) are divided by T; a parallel-encoded chunk's keys were never in context with
# their new neighbours, and a temperature fitted on a calibration set corrects part of that
TEMP_TAG = "temp"
# `minN`: a share of a short prompt's fused tokens is a handful, while the request's fixed work
# (the dense layers over every token, the question on every layer) stays; at least N tokens
# recomputed buys most of the agreement a larger share gives there, for little time
MIN_TAG = "min"


POLICIES: tuple[PolicyEntry, ...] = (
    PolicyEntry("full", "the whole prompt computed, no reuse (the baseline: token for token a plain LLM)",
                tempers=False),
    PolicyEntry("prefix", "exact prefix reuse only (template, conversation, CP-Tree chunk prefix), the rest "
                "computed", tempers=False),
    PolicyEntry("reuse", "every cached chunk reused as is at its new position, nothing recomputed"),
    PolicyEntry("cacheblend", "CacheBlend: the top-ratio tokens by KV deviation at the check layer recomputed "
                "(default 0.15; auto: from the engine's measured load and compute costs; gradual: 3r, 2r, r "
                "over three layers; minN: at least N fused tokens, all of them when fewer)", arg="ratio",
                default=0.15, auto=True, option="gradual", floor=True),
    PolicyEntry("focus", "the top-ratio fused tokens by the question's attention recomputed (default 0.15)",
                arg="ratio", default=0.15),
    PolicyEntry("prophet", "question-driven: a probe of the question over the reused KV at every layer scores "
                "each fused token (attention normalized per head, averaged over layers); the top-ratio tokens, "
                "each with one neighbour on either side, recomputed from layer 0 (default 0.15; nowindow: no "
                "neighbours; probeL: the probe runs the first L layers only)", arg="ratio", default=0.15,
                option="nowindow", probe=True),
    PolicyEntry("mix", "CacheBlend's KV deviation and prophet's question attention combined: every fused token "
                "computed to the check layer, then the top-ratio tokens by the mean of their two percentile ranks "
                "kept (default 0.15; split: half the budget by each score; probeL: the probe runs the first L "
                "layers only)", arg="ratio", default=0.15, option="split", probe=True),
    PolicyEntry("gate", "confidence-gated: the prophet probe also predicts the first answer token over the reused "
                "KV; where p(top 1) - p(top 2) >= 0.5 nothing is recomputed (reuse), otherwise the top-ratio tokens "
                "as for prophet (default 0.3; the cost varies per request)", arg="ratio", default=0.3),
    PolicyEntry("epic", "EPIC: the first k tokens of each fused chunk recomputed (default 16)", arg="k", default=16),
    PolicyEntry("cachetune", "CacheTune: the top-ratio tokens of each chunk by low-frequency K/V energy recomputed "
                "from layer 0 (default 0.15; auto as for cacheblend)", arg="ratio", default=0.15, auto=True),
    PolicyEntry("cachecraft", "Cache-Craft: chunk variants, recompute share alpha x CCI x (1 - beta') (default "
                "alpha 1; nostop: no focused-chunk early termination)", arg="alpha", default=1.0,
                option="nostop"),
)

# every policy the grammar accepts: the built-in ones, then any an engine-side plugin added
BY_NAME: dict[str, PolicyEntry] = {p.name: p for p in POLICIES}
NAMES: tuple[str, ...] = tuple(BY_NAME)  # the built-in ones
DEFAULT_POLICY = "cacheblend:0.15:min24"


def add_policy_entry(entry: PolicyEntry) -> Callable[[], None]:
    """Accept `entry`'s policy from now on, in this process (the engine's `register_policy` calls
    this beside the class that runs it); returns the function that removes it again. A client
    process that validates specs without the engine does not see it."""
    if entry.name in BY_NAME:
        raise ValueError(f"policy '{entry.name}' is already in the grammar")
    if not entry.name.isidentifier() or entry.name != entry.name.lower():
        raise ValueError(f"a policy name is a lowercase identifier, got '{entry.name}'")
    BY_NAME[entry.name] = entry

    def remove() -> None:
        if BY_NAME.get(entry.name) is entry:
            del BY_NAME[entry.name]

    return remove


def forms() -> list[str]:
    return [p.form for p in BY_NAME.values()]


def forms_text(sep: str = " | ") -> str:
    """`full | prefix | ... | cachecraft[:alpha[:nostop]]`: the whole grammar on one line."""
    return sep.join(forms())


def valid_policies_text() -> str:
    """The valid forms as a sentence ending of an error message: 'full, prefix, ... or cachecraft[...]'."""
    *head, last = forms()
    return f"{', '.join(head)} or {last}"


def policy_help() -> str:
    """For `--policy` help and field descriptions: the grammar, then what each policy does."""
    lines = "; ".join(f"{p.name} = {p.summary}" for p in BY_NAME.values())
    return (f"{forms_text()} (default {DEFAULT_POLICY}). {lines}. Every policy but full and prefix also takes "
            f":{TEMP_TAG}T after its argument, an attention temperature T in [{TEMP_RANGE[0]:g}, {TEMP_RANGE[1]:g}] on "
            f"the reused chunk KV (APE; e.g. cacheblend:0.15:temp1.1, reuse:temp1.1, cachecraft:temp20)")


@dataclass(frozen=True)
class PolicySpec:
    """A checked policy string. `value` is the argument with the default filled in."""

    name: str
    value: float | int | None = None
    auto: bool = False
    option: bool = False
    probe_layers: int | None = None  # `probeL`: the question probe's depth (None: every layer)
    temperature: float | None = None  # `tempT`: attention temperature on the reused chunk KV (None: 1)
    min_tokens: int = 0  # `minN`: fused tokens recomputed at least


def _value(entry: PolicyEntry, text: str, spec: str) -> float | int:
    assert entry.arg is not None and entry.default is not None
    bad = PolicySpecError(f"bad argument in policy '{spec}': {entry.arg} must be {_ARG_RULES[entry.arg]}, "
                          f"got '{text}' (form: {entry.form})")
    if not (_WHOLE if entry.arg == "k" else _DECIMAL).fullmatch(text):
        raise bad
    value: float | int = int(text) if entry.arg == "k" else float(text)
    low, high = ARG_RANGES[entry.arg]
    if not (math.isfinite(value) and low <= value <= high):
        raise bad
    return value


def parse_policy_spec(spec: str) -> PolicySpec:
    """Check a policy string against the grammar; raise `PolicySpecError` naming the valid forms."""
    try:
        return _parse(spec)
    except PolicySpecError as exc:
        # the message quotes what the client sent: control characters shown escaped, so the error
        # stays one line whatever was sent
        raise PolicySpecError("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(exc))) from None


def _parse(spec: str) -> PolicySpec:
    name, *parts = spec.split(":")
    entry = BY_NAME.get(name)
    if entry is None:
        raise PolicySpecError(f"unknown policy '{spec}': use {valid_policies_text()}")
    if any(not part for part in parts):
        raise PolicySpecError(f"bad policy '{spec}': a ':' must be followed by a value (form: {entry.form}; "
                              f"leave a field out rather than empty)")
    if entry.arg is None:
        # no argument: only tags may follow (`reuse:temp1.1`)
        if parts and not (entry.tempers and all(p.startswith(TEMP_TAG) for p in parts)):
            raise PolicySpecError(f"bad argument in policy '{spec}': {name} takes no argument (form: {entry.form})")
        tags = _tags(entry, parts, spec)
        return PolicySpec(name, temperature=tags.temperature)
    if parts and _is_tag(entry, parts[0]):
        parts = ["", *parts]  # tags right after the name: the argument left at its default
    arg = parts[0] if parts else ""
    tags = _tags(entry, parts[1:], spec)
    auto = entry.auto and arg == "auto"
    value = entry.default if not arg or auto else _value(entry, arg, spec)
    return PolicySpec(name, value, auto, tags.option, tags.probe_layers, tags.temperature, tags.min_tokens or 0)


def _is_tag(entry: PolicyEntry, field: str) -> bool:
    """Whether `field` is one of the tags this policy takes (an argument is a number or `auto`, so
    the two never look alike)."""
    return bool(field) and (field == entry.option or (entry.probe and field.startswith(PROBE_TAG))
                            or (entry.floor and field.startswith(MIN_TAG))
                            or (entry.tempers and field.startswith(TEMP_TAG)))


@dataclass
class _Tags:
    option: bool = False
    probe_layers: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None


def _tags(entry: PolicyEntry, tags: list[str], spec: str) -> _Tags:
    """The tags after the argument (none of them empty: the caller checked), each at most once."""
    found = _Tags()
    for tag in tags:
        if entry.option is not None and tag == entry.option and not found.option:
            found.option = True
        elif entry.probe and tag.startswith(PROBE_TAG) and found.probe_layers is None:
            found.probe_layers = _whole_tag(tag, PROBE_TAG, "L", PROBE_RANGE, "the layers the probe runs", entry, spec)
        elif entry.floor and tag.startswith(MIN_TAG) and found.min_tokens is None:
            found.min_tokens = _whole_tag(tag, MIN_TAG, "N", MIN_RANGE, "the fused tokens recomputed at least", entry, spec)
        elif entry.tempers and tag.startswith(TEMP_TAG) and found.temperature is None:
            found.temperature = _temperature(tag, spec)
        else:
            words = [f"'{entry.option}'"] if entry.option else []
            words += [f"{PROBE_TAG}L"] if entry.probe else []
            words += [f"{MIN_TAG}N"] if entry.floor else []
            words += [f"{TEMP_TAG}T"] if entry.tempers else []
            allowed = ("none" if not words else f"only {words[0]}" if len(words) == 1
                       else f"only {', '.join(words[:-1])} and {words[-1]}, each once")
            raise PolicySpecError(f"bad argument in policy '{spec}': unknown {entry.name} option "
                                  f"'{':'.join(tags)}' ({allowed}; form: {entry.form})")
    return found


def _whole_tag(tag: str, prefix: str, letter: str, bounds: tuple[int, int], what: str, entry: PolicyEntry,
               spec: str) -> int:
    """The whole number after `prefix` in a tag such as `probe8` (`letter` names it in the error)."""
    digits = tag[len(prefix):]
    low, high = bounds
    if not _WHOLE.fullmatch(digits) or not low <= int(digits) <= high:
        raise PolicySpecError(f"bad argument in policy '{spec}': {prefix}{letter} needs {letter}, {what}, a whole "
                              f"number in [{low}, {high}], got '{tag}' (form: {entry.form})")
    return int(digits)


def _temperature(tag: str, spec: str) -> float:
    text = tag[len(TEMP_TAG):]
    low, high = TEMP_RANGE
    value = float(text) if _DECIMAL.fullmatch(text) else math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise PolicySpecError(f"bad argument in policy '{spec}': {TEMP_TAG}T needs T, the attention temperature on "
                              f"the reused chunk KV, a number in [{low:g}, {high:g}], got '{tag}' (e.g. {TEMP_TAG}1.1)")
    return value


def check_policy(spec: str) -> str:
    """The spec unchanged when it is valid (for pydantic validators and argparse `type=`)."""
    parse_policy_spec(spec)
    return spec


def policy_arg(text: str) -> str:
    """argparse `type=`: a bad `--policy` becomes one usage line naming the valid forms."""
    try:
        return check_policy(text)
    except PolicySpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def policy_list_arg(text: str) -> str:
    """argparse `type=` for a comma list of policies (`full,reuse,cacheblend:0.15`), kept as given."""
    for spec in text.split(","):
        if spec.strip():
            policy_arg(spec.strip())
    return text


__all__ = ["ARG_RANGES", "BY_NAME", "PROBE_RANGE", "TEMP_RANGE", "DEFAULT_POLICY", "NAMES", "POLICIES", "PROBE_TAG", "TEMP_TAG", "PolicyEntry", "PolicySpec", "PolicySpecError",
           "add_policy_entry", "check_policy", "forms", "forms_text", "parse_policy_spec", "policy_arg", "policy_help", "policy_list_arg",
           "valid_policies_text"]
