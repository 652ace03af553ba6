"""`ragcache bench gpu`'s tile sweep: the Triton selective attention at each candidate tile
(`TILE_CANDIDATES`: BLOCK_M x BLOCK_N, warps, pipeline stages) against the tile it uses by
default, at the launches a request makes: a fused prefill's recomputed rows, a full prefill's
every row, a `reuse` request's few question rows. The defaults were chosen without a card; this
is the measurement that picks them on one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# (label, query heads, KV heads, head dim): Llama-3-8B's, the shape the targets are set on (each
# head shape adds two compiles per tile)
HEADS = (("8B heads", 32, 8, 128),)
KEYS = 6231
# label -> rows asked: 15% recomputed (scattered), every row (a full prefill), a question's rows
LAUNCHES = (("fused rows", 934), ("every row", KEYS), ("question rows", 38))
QUICK = {"keys": 512, "rows": {"fused rows": 80, "every row": 512, "question rows": 16}}

Timer = Callable[[torch.device, Callable[[], Any], int], float]


def tile_name(tile: tuple[int, int, int, int]) -> str:
    m, n, warps, stages = tile
    return f"{m}x{n} w{warps} s{stages}"


def default_tile(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The tile a launch gets when none is named (Triton's launch defaults: 4 warps, 3 stages)."""
    from ragcache_kernels.triton_attention import default_blocks

    return (*default_blocks(head_dim, dtype), 4, 3)


def tile_sweep(device: torch.device, quick: bool, timed: Timer,
               heads: tuple[tuple[str, int, int, int], ...] = HEADS, keys: int | None = None) -> list[dict[str, Any]]:
    """One row per (heads, launch): every candidate's median ms, the launch as the engine makes it
    (its default tile), and the best candidate."""
    from ragcache_kernels import triton_attention

    gen = torch.Generator().manual_seed(3)
    keys = keys or (QUICK["keys"] if quick else KEYS)
    repeats = 1 if quick else 30
    rows: list[dict[str, Any]] = []
    for label, h, hkv, d in heads:
        k, v = (torch.randn(keys, hkv, d, generator=gen).to(device, torch.bfloat16) for _ in range(2))
        positions = torch.arange(keys, device=device)
        for launch, asked in LAUNCHES:
            count = min(QUICK["rows"][launch] if quick else asked, keys)
            picked = (positions[-count:] if launch == "question rows"
                      else torch.randperm(keys, generator=gen)[:count].sort().values.to(device))
            q = torch.randn(count, h, d, generator=gen).to(device, torch.bfloat16)
            launch_as_is = functools.partial(triton_attention.selective_attention, q, k, v, picked, positions)
            default_ms = round(timed(device, launch_as_is, repeats) * 1e3, 4)  # what the engine launches
            times = {}
            for tile in triton_attention.TILE_CANDIDATES:
                m, n, warps, stages = tile
                call = functools.partial(launch_as_is, block_m=m, block_n=n, num_warps=warps, num_stages=stages)
                times[tile_name(tile)] = round(timed(device, call, repeats) * 1e3, 4)
            best = min(times, key=times.__getitem__)
            rows.append({"heads": label, "launch": launch, "keys": keys, "queries": count, "ms": times,
                         "default": tile_name(default_tile(d, torch.bfloat16)), "default_ms": default_ms,
                         "best": best, "best_ms": times[best], "default_over_best": round(default_ms / times[best], 2)})
    return rows


def tile_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["Selective attention tiles (bf16; ms; BLOCK_M x BLOCK_N, warps, stages):", "",
             "| heads | launch | keys | queries | default | default ms | best | best ms | default / best |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['heads']} | {r['launch']} | {r['keys']} | {r['queries']} | {r['default']} | {r['default_ms']} | "
              f"{r['best']} | {r['best_ms']} | {r['default_over_best']}× |" for r in rows]
    return lines + [""]
