"""The engine's settings: one object with a part per concern, read by the engine and the planner.

Every setting also has a flat keyword name, unique across the parts (`ram_cache_bytes`,
`promote_threshold`): `EngineConfig.from_options` and `Engine.from_pretrained(**options)` take
those, so a caller never has to know which part a setting lives in.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Convention = Literal["isolated", "after-prefix"]
# in-place: a missed chunk is computed inside the request (as full prefill would) and its KV kept
# afterwards; inline: computed alone first, then fused (a miss costs twice); background: the
# request computes it fresh and a worker computes it alone afterwards
Precompute = Literal["in-place", "inline", "background"]
GraphMode = Literal["auto", "off", "on"]

FLAT = "flat"  # field metadata: the setting's flat keyword name, where it differs from the field's
FLAG = "flag"  # field metadata: the setting's command-line flag (a Flag), where it has one

# how a flag's text becomes the setting's value (engine_args maps each to an argparse type)
Parse = Literal["text", "path", "non_negative", "above_zero", "whole", "positive", "temperature", "fraction"]
GIB, MIB = 1 << 30, 1 << 20
# the largest byte budget a flag takes (1 PiB): past it a value is a typo or 'inf', and a budget
# meant as 'no limit' has its own spelling (0 where the flag's help says so)
MAX_BUDGET_BYTES = 1 << 50


@dataclass(frozen=True)
class Flag:
    """A setting as every engine-running command takes it: written here once, with its help, so
    the flags are generated from the config (engine_args.add_engine_arguments)."""

    name: str  # "--ram-cache-gb"
    help: str  # what it does; the default is appended from the field
    parse: Parse = "text"
    unit: int = 1  # the setting's units per unit of the flag (GIB: the flag takes GiB, the setting bytes)
    negates: bool = False  # a setting on by default, which this flag turns off
    aliases: tuple[str, ...] = ()  # other names for the same flag


def setting(default: Any, flag: Flag | None = None, flat: str | None = None, factory: Any = None) -> Any:
    """A config field with its flat keyword (where it differs from the field's name) and flag."""
    metadata: dict[str, Any] = {}
    if flat is not None:
        metadata[FLAT] = flat
    if flag is not None:
        metadata[FLAG] = flag
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class StoreConfig:
    """The chunk store's tiers, and how the disk tier is read during a prefill."""

    cache_dir: Path | None = setting(None, Flag("--cache-dir", "disk tier folder (default: $RAGCACHE_HOME/kv)",
                                                parse="path"))
    disk: bool = setting(True, Flag("--no-disk", "keep chunk KV in RAM only", negates=True))
    ram_bytes: int = setting(2 << 30, Flag("--ram-cache-gb", "the first tier's capacity in GiB: host RAM on a CPU, "
                                           "device memory on a GPU (--gpu-cache-gb is the same flag)",
                                           parse="non_negative", unit=GIB, aliases=("--gpu-cache-gb",)),
                             flat="ram_cache_bytes")
    host_bytes: int = setting(0, Flag("--host-cache-gb", "on a GPU, a host-RAM tier in GiB behind device memory: "
                                      "chunk KV evicted from the device moves there (pinned) and comes back with "
                                      "an asynchronous copy instead of a disk read (0 = off; a CPU ignores it, its "
                                      "first tier is host RAM already)", parse="non_negative", unit=GIB),
                              flat="host_cache_bytes")
    disk_bytes: int = setting(20 << 30, Flag("--disk-cache-gb", "disk tier budget in GiB, least recently used files "
                                             "removed first (0 = unlimited)", parse="non_negative", unit=GIB),
                              flat="disk_cache_bytes")
    prefetch: bool = setting(True, Flag("--no-prefetch", "read disk-tier chunk KV whole before the prefill instead "
                                        "of layer by layer during it", negates=True))
    redis_url: str | None = setting(None, Flag(
        "--redis-url", "a Redis tier behind RAM and disk, shared by every sidecar given the same URL, e.g. "
        "redis://localhost:6379/0 (default: off)"))
    redis_ttl_s: float = setting(86400.0, Flag("--redis-ttl", "seconds a Redis entry lives unused; every hit "
                                               "refreshes it (0 = no expiry)", parse="non_negative"))


@dataclass
class ReuseConfig:
    """How chunk KV is computed, found and kept: misses, the CA-Table, the CP-Tree, Cache-Craft."""

    convention: Convention = setting("isolated", Flag(
        "--convention", "how `warm` and --precompute inline/background compute a chunk's KV: alone at position 0, "
        "or right after the system prefix"))
    precompute: Precompute = setting("in-place", Flag(
        "--precompute", "in-place: a missed chunk is computed inside the request, as full prefill would, and its "
        "KV kept for later requests; inline: computed alone first, then fused (a miss costs twice); background: "
        "computed alone by a worker after the request"))
    ca_window: int = 1000  # CA-Table sliding window, in requests
    prefix_tree: bool = setting(True, Flag("--no-prefix-tree", "turn off CP-Tree exact chunk-prefix reuse "
                                           "(fusion only)", negates=True))
    promote_threshold: int = 2  # CA-Table count every chunk of a path needs before it is stored
    # the same for a chunk fusion already holds, where a node costs a full compute of the chunk
    # instead of a fused one; None: never (promoting turns reusable chunk reads into full
    # computes: warm TTFT got slower, docs/architecture.md)
    fusion_promote_threshold: int | None = None
    # the attention temperature on reused chunk KV (tempT, APE) for a policy that names none:
    # "auto" = the T fitted for this model and policy family (calibration.py; 1 where none was
    # fitted), "off" = 1, or one number > 0 for every policy that fuses
    fused_temperature: str | float = setting("auto", Flag(
        "--fused-temperature", "attention temperature on reused chunk KV for a --policy without :tempT: auto = the "
        "T fitted for this model and policy family (`ragcache calibrate-temperature --save`; the default SmolLM2 "
        "ships cacheblend's), off = 1, or one number > 0 for every fusing policy", parse="temperature"))
    verify_fraction: float = setting(0.0, Flag(
        "--verify-fraction", "share of the requests that reused KV for which full prefill's first token is computed "
        "too (after the request's first token is out) and compared: the outcome is in the request's stats "
        "(verified_first_token) and in /metrics (ragcache_verify_total), so drift from full prefill shows in "
        "production; each check costs one full prefill (0: off)", parse="fraction"))
    cachecraft_variants_per_chunk: int = 4  # Cache-Craft's M
    cachecraft_max_chunks: int = 1024  # Cache-Craft's N: N * M variants in all


@dataclass
class ConversationConfig:
    """Kept conversation histories and their bounds."""

    dedup: bool = setting(True, flat="conversation_dedup")  # drop chunks it holds from the next turn
    ttl_s: float = setting(900.0, flat="conversation_ttl_s")
    max_tokens: int = setting(6144, flat="conversation_max_tokens")
    max_count: int = setting(64, Flag("--conversations", "conversations whose KV is kept for their next turn, least "
                                      "recently used out first (0 keeps none)", parse="whole"),
                             flat="conversation_max_count")
    ram_bytes: int = setting(512 << 20, Flag("--conversation-ram-gb", "RAM for all kept conversations' KV "
                                             "together, apart from --ram-cache-gb", parse="non_negative", unit=GIB),
                             flat="conversation_ram_bytes")


@dataclass
class BatchingConfig:
    """How many sequences the scheduler runs together."""

    max_batch: int = setting(16, Flag("--max-batch", "requests decoded together in one batched step (1 serves one "
                                      "at a time)", parse="positive"))
    kv_bytes: int = setting(4 << 30, Flag("--batch-kv-gb", "KV of the running requests together, prompt + "
                                          "max_tokens each; a request that does not fit waits (one always runs)",
                                          parse="non_negative", unit=GIB), flat="batch_kv_bytes")
    kv_block_size: int = setting(0, Flag(
        "--kv-block-size", "0 (default): each running request holds a buffer of its own, prompt + max_tokens rows "
        "of keys before and after RoPE and values; N: the running requests' KV lives in one pool of N-row blocks "
        "sized by --batch-kv-gb, rotated keys and values only (2/3 of the bytes per row), a request's blocks taken "
        "as it grows and given back when it ends; a request is admitted while the free blocks hold its prompt, and "
        "when the running requests outgrow the pool the newest is preempted, recomputed and resumed later. Decode "
        "steps are then not captured as CUDA graphs", parse="whole"))
    prefill_token_budget: int = setting(8192, Flag(
        "--prefill-token-budget", "prompt tokens one scheduler step prefills before the running requests' next "
        "decode step (at least one request, whatever its length); while requests decode, a prefill computing more "
        "than this many tokens times the model's layers pauses between two layers for their decode step: lower "
        "keeps streams' inter-token latency flat under long prompts and bursts, higher lets new requests start "
        "sooner", parse="positive"))
    decode_graphs: GraphMode = setting("auto", Flag(
        "--decode-graphs", "auto (default) or on: on a GPU with the Triton kernels, each decode step replays a CUDA "
        "graph captured once per batch size (1, 2, 4, ... up to --max-batch; captured on first use), instead of "
        "launching hundreds of kernels one by one; off: launched one by one. auto decodes op by op where graphs "
        "cannot run (a CPU), on says so in the log"))
    prefill_graphs: GraphMode = setting("auto", Flag(
        "--prefill-graphs", "auto (default) or on: on a GPU with the Triton kernels, a fused prefill's layers after "
        "the policy's last choice of rows (every layer under reuse, epic and prophet; those after the check under "
        "cacheblend) replay a CUDA graph captured once per row bucket (16 to 1,024 rows; at load for reuse's and "
        "cacheblend's first layers, else on first use) instead of launching their kernels one by one; auto runs op "
        "by op where graphs cannot run (a CPU), on says so in the log. off: launched one by one"))


@dataclass
class EngineConfig:
    model: str = setting("default", Flag("--model", "'default' (SmolLM2-135M-Instruct, prepared on first use) or "
                                         "a local HF model folder"))
    device: str = setting("auto", Flag("--device", "auto | cpu | cuda"))
    dtype: str = setting("auto", Flag("--dtype", "auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on "
                                      "GPU)"))
    threads: int | None = setting(None, Flag("--threads", "torch CPU threads (default: torch's choice)",
                                             parse="positive"))
    store: StoreConfig = setting(None, factory=StoreConfig)
    reuse: ReuseConfig = setting(None, factory=ReuseConfig)
    conversations: ConversationConfig = setting(None, factory=ConversationConfig)
    batching: BatchingConfig = setting(None, factory=BatchingConfig)

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """A config from top-level fields, whole parts (`store=StoreConfig(...)`) and any part's
        setting by its flat name (`ram_cache_bytes=...`); a flat setting wins over its part's."""
        flat = flat_options()
        unknown = sorted(set(options) - set(flat) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        given = {k: v for k, v in options.items() if k not in flat or flat[k][0] is None}
        # copies of the parts given, so flat settings never change the caller's objects
        config = cls(**{k: dataclasses.replace(v) if k in parts() else v for k, v in given.items()})
        for name, value in options.items():
            part, attr = flat.get(name, (None, name))
            if part is not None:
                setattr(getattr(config, part), attr, value)
        return config


def parts() -> dict[str, type]:
    """EngineConfig's parts: field name -> dataclass."""
    return {f.name: f.default_factory for f in dataclasses.fields(EngineConfig)  # type: ignore[misc]
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


def flat_options() -> dict[str, tuple[str | None, str]]:
    """Every setting's flat keyword name -> (its part, or None at the top level; its field)."""
    out: dict[str, tuple[str | None, str]] = {}
    part_types = parts()
    for f in dataclasses.fields(EngineConfig):
        if f.name not in part_types:
            out[f.name] = (None, f.name)
            continue
        for sub in dataclasses.fields(part_types[f.name]):
            out[sub.metadata.get(FLAT, sub.name)] = (f.name, sub.name)
    return out


@dataclass(frozen=True)
class FlagSetting:
    flat: str  # the setting's flat keyword
    field: dataclasses.Field
    flag: Flag
    choices: tuple[str, ...]  # the values a Literal-typed setting allows; () for any


def flags() -> list[FlagSetting]:
    """Every engine setting that has a flag, in the config's order."""
    out = []
    where = {spot: name for name, spot in flat_options().items()}
    part_types = parts()
    for top in dataclasses.fields(EngineConfig):
        if top.name in part_types:
            out += [dataclasses.replace(s, flat=where[(top.name, s.field.name)])
                    for s in dataclass_flags(part_types[top.name])]
        elif FLAG in top.metadata:
            out += [s for s in dataclass_flags(EngineConfig) if s.field.name == top.name]
    return out


def dataclass_flags(cls: type) -> list[FlagSetting]:
    """The fields of one dataclass that have a flag (keyed by field name), in its order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if FLAG in f.metadata:
            hint = hints[f.name]
            choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
            out.append(FlagSetting(f.name, f, f.metadata[FLAG], choices))
    return out
