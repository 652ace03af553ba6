"""The engine's settings: one object with a part per concern, read by the engine and the planner.

Every setting also has a flat keyword name, unique across the parts (`ram_cache_bytes`,
`promote_threshold`): `EngineConfig.from_options` and `Engine.from_pretrained(**options)` take
those, so a caller never has to know which part a setting lives in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Convention = Literal["isolated", "after-prefix"]
# in-place: a missed chunk is computed inside the request (as full prefill would) and its KV kept
# afterwards; inline: computed alone first, then fused (a miss costs twice); background: the
# request computes it fresh and a worker computes it alone afterwards
Precompute = Literal["in-place", "inline", "background"]

FLAT = "flat"  # field metadata: the setting's flat keyword name, where it differs from the field's


@dataclass
class StoreConfig:
    """The chunk store's tiers, and how the disk tier is read during a prefill."""

    cache_dir: Path | None = None  # None -> $RAGCACHE_HOME/kv; disk tier off with disk=False
    disk: bool = True
    ram_bytes: int = field(default=2 << 30, metadata={FLAT: "ram_cache_bytes"})
    # disk tier budget, least recently used files out first; 0 = unlimited
    disk_bytes: int = field(default=20 << 30, metadata={FLAT: "disk_cache_bytes"})
    prefetch: bool = True  # read disk-tier chunk KV layer by layer while earlier layers compute
    # a Redis tier behind RAM and disk, shared by every sidecar given the same URL; None = off
    redis_url: str | None = None
    redis_ttl_s: float = 86400.0  # each Redis entry's time to live, refreshed on every hit


@dataclass
class ReuseConfig:
    """How chunk KV is computed, found and kept: misses, the CA-Table, the CP-Tree, Cache-Craft."""

    convention: Convention = "isolated"
    precompute: Precompute = "in-place"
    ca_window: int = 1000  # CA-Table sliding window, in requests
    prefix_tree: bool = True  # CP-Tree exact chunk-prefix reuse
    promote_threshold: int = 2  # CA-Table count every chunk of a path needs before it is stored
    # the same for a chunk fusion already holds, where a node costs a full compute of the chunk
    # instead of a fused one; None: never (promoting turns reusable chunk reads into full
    # computes: warm TTFT got slower, docs/architecture.md)
    fusion_promote_threshold: int | None = None
    # the attention temperature on reused chunk KV (tempT, APE) for a policy that names none:
    # "auto" = the T fitted for this model and policy family (calibration.py; 1 where none was
    # fitted), "off" = 1, or one number > 0 for every policy that fuses
    fused_temperature: str | float = "auto"
    cachecraft_variants_per_chunk: int = 4  # Cache-Craft's M
    cachecraft_max_chunks: int = 1024  # Cache-Craft's N: N * M variants in all


@dataclass
class ConversationConfig:
    """Kept conversation histories and their bounds."""

    dedup: bool = field(default=True, metadata={FLAT: "conversation_dedup"})  # drop chunks it holds from the next turn
    ttl_s: float = field(default=900.0, metadata={FLAT: "conversation_ttl_s"})
    max_tokens: int = field(default=6144, metadata={FLAT: "conversation_max_tokens"})
    # kept conversations, least recently used out first
    max_count: int = field(default=64, metadata={FLAT: "conversation_max_count"})
    # all kept histories' KV together, apart from the store's RAM tier
    ram_bytes: int = field(default=512 << 20, metadata={FLAT: "conversation_ram_bytes"})


@dataclass
class BatchingConfig:
    """How many sequences the scheduler runs together."""

    max_batch: int = 16  # sequences decoded together in one batched step
    # KV of the running sequences together (prompt + max_tokens each)
    kv_bytes: int = field(default=4 << 30, metadata={FLAT: "batch_kv_bytes"})


@dataclass
class EngineConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    store: StoreConfig = field(default_factory=StoreConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    conversations: ConversationConfig = field(default_factory=ConversationConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)

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
