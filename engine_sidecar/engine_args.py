"""The engine flags every engine-running command shares, and the Engine they build.

Kept below both `cli.py` and `bench/*` (and `demo.py`), which import it; the CLI imports the
benchmarks, so the benchmarks must not import the CLI. argparse only: the engine (torch) is
imported when `engine_from_args` runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _int_within(text: str, low: int, high: int | None, refusal: str) -> int:
    """`text` as an int in [low, high]; otherwise argparse's one-line error saying `refusal`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{refusal}, got {text}")
    return value


def port_number(text: str) -> int:
    return _int_within(text, 0, 65535, "must be a TCP port from 0 to 65535 (0: a free one)")


def whole_number(text: str) -> int:
    return _int_within(text, 0, None, "must be >= 0")


def positive_int(text: str) -> int:
    return _int_within(text, 1, None, "must be at least 1")


def fused_temperature_arg(text: str) -> str | float:
    from engine_sidecar.calibration import TemperatureSettingError, check_setting

    try:
        return check_setting(text)
    except TemperatureSettingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct, prepared on first use) or a local HF model folder")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--cache-dir", type=Path, default=None, help="disk tier folder (default: $RAGCACHE_HOME/kv)")
    p.add_argument("--no-disk", action="store_true", help="keep chunk KV in RAM only")
    p.add_argument("--ram-cache-gb", type=non_negative, default=2.0, help="RAM tier capacity in GiB (default 2)")
    p.add_argument("--disk-cache-gb", type=non_negative, default=20.0,
                   help="disk tier budget in GiB, least recently used files removed first (default 20; 0 = unlimited)")
    p.add_argument("--redis-url", default=None,
                   help="a Redis tier behind RAM and disk, shared by every sidecar given the same URL, e.g. "
                        "redis://localhost:6379/0 (default: off)")
    p.add_argument("--redis-ttl", type=non_negative, default=86400.0,
                   help="seconds a Redis entry lives unused; every hit refreshes it (default 86400; 0 = no expiry)")
    p.add_argument("--convention", choices=["isolated", "after-prefix"], default="isolated",
                   help="how `warm` and --precompute inline/background compute a chunk's KV: alone at position 0, "
                        "or right after the system prefix")
    p.add_argument("--precompute", choices=["in-place", "inline", "background"], default="in-place",
                   help="in-place (default): a missed chunk is computed inside the request, as full prefill "
                        "would, and its KV kept for later requests; inline: computed alone first, then fused "
                        "(a miss costs twice); background: computed alone by a worker after the request")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="read disk-tier chunk KV whole before the prefill instead of layer by layer during it")
    p.add_argument("--no-prefix-tree", action="store_true",
                   help="turn off CP-Tree exact chunk-prefix reuse (fusion only)")
    p.add_argument("--conversations", type=int, default=64,
                   help="conversations whose KV is kept for their next turn, least recently used out first "
                        "(default 64; 0 keeps none)")
    p.add_argument("--conversation-ram-gb", type=non_negative, default=0.5,
                   help="RAM for all kept conversations' KV together, apart from --ram-cache-gb (default 0.5)")
    p.add_argument("--fused-temperature", type=fused_temperature_arg, default="auto",
                   help="attention temperature on reused chunk KV for a --policy without :tempT: auto (default) "
                        "= the T fitted for this model and policy family (`ragcache calibrate-temperature --save`; "
                        "the default SmolLM2 ships cacheblend's), off = 1, or one number > 0 for every fusing policy")
    p.add_argument("--max-batch", type=positive_int, default=16,
                   help="requests decoded together in one batched step (default 16; 1 serves one at a time)")
    p.add_argument("--batch-kv-gb", type=non_negative, default=4.0,
                   help="KV of the running requests together, prompt + max_tokens each; a request that does "
                        "not fit waits (one always runs) (default 4)")


def engine_from_args(args: argparse.Namespace):
    from engine_sidecar.engine import Engine

    return Engine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir, disk=not args.no_disk,
        ram_cache_bytes=int(args.ram_cache_gb * (1 << 30)), convention=args.convention,
        disk_cache_bytes=int(getattr(args, "disk_cache_gb", 20.0) * (1 << 30)),
        precompute=args.precompute, threads=args.threads, prefix_tree=not getattr(args, "no_prefix_tree", False),
        prefetch=not getattr(args, "no_prefetch", False),
        conversation_max_count=getattr(args, "conversations", 64),
        conversation_ram_bytes=int(getattr(args, "conversation_ram_gb", 0.5) * (1 << 30)),
        max_batch=getattr(args, "max_batch", 16), fused_temperature=getattr(args, "fused_temperature", "auto"),
        batch_kv_bytes=int(getattr(args, "batch_kv_gb", 4.0) * (1 << 30)),
        redis_url=getattr(args, "redis_url", None), redis_ttl_s=getattr(args, "redis_ttl", 86400.0),
    )
