"""The engine's settings: one dataclass, read by the engine and the planner."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Convention = Literal["isolated", "after-prefix"]
# in-place: a missed chunk is computed inside the request (as full prefill would) and its KV kept
# afterwards; inline: computed alone first, then fused (a miss costs twice); background: the
# request computes it fresh and a worker computes it alone afterwards
Precompute = Literal["in-place", "inline", "background"]


@dataclass
class EngineConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: Path | None = None  # None -> $RAGCACHE_HOME/kv; disk tier off with disk=False
    disk: bool = True
    ram_cache_bytes: int = 2 << 30
    disk_cache_bytes: int = 20 << 30  # disk tier budget, least recently used files out first; 0 = unlimited
    convention: Convention = "isolated"
    precompute: Precompute = "in-place"
    threads: int | None = None
    ca_window: int = 1000  # CA-Table sliding window, in requests
    prefix_tree: bool = True  # CP-Tree exact chunk-prefix reuse
    promote_threshold: int = 2  # CA-Table count every chunk of a path needs before it is stored
    # the same for a chunk fusion already holds, where a node costs a full compute of the chunk
    # instead of a fused one; None: never (measured on the documents stream: promoting at 4 turned
    # 82 of 548 reusable chunk reads into full computes and made warm TTFT 1.3x slower)
    fusion_promote_threshold: int | None = None
    conversation_dedup: bool = True  # drop chunks a conversation already holds from its next turn
    conversation_ttl_s: float = 900.0
    conversation_max_tokens: int = 6144
    conversation_max_count: int = 64  # kept conversations (least recently used out first)
    conversation_ram_bytes: int = 512 << 20  # all kept histories' KV together (apart from ram_cache_bytes)
    cachecraft_variants_per_chunk: int = 4  # Cache-Craft's M
    cachecraft_max_chunks: int = 1024  # Cache-Craft's N: N * M variants in all
    prefetch: bool = True  # read disk-tier chunk KV layer by layer while earlier layers compute
    max_batch: int = 16  # sequences decoded together in one batched step
    batch_kv_bytes: int = 4 << 30  # KV of the running sequences together (prompt + max_tokens each)
