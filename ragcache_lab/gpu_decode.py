"""`ragcache bench gpu`'s decode sections: tokens/s at several concurrencies, launched op by op and
(on a GPU) replayed from CUDA graphs, and the guard that a replayed step computes what the op by op
step computes."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ragcache_lab.gpu_counts import launches
from ragcache_lab.gpu_models import (
    SHAPES,
    engine_on,
    model_folder,
    param_bytes,
    passages,
    random_runner,
)

GUARD_STEPS = ([11, 12, 13], [40, 41, 42], [7, 8, 9], [100, 200, 300])


def decode_section(name: str, device: torch.device, dtype: torch.dtype, tokenizer_dir: Path, work: Path,
                   args: argparse.Namespace, peaks: dict[str, float], graphs: bool = False,
                   kv_block_size: int = 0) -> dict[str, Any]:
    """Output tokens/s of `args.concurrency` concurrent greedy requests of `args.decode_tokens`
    tokens each (`ignore_eos`), with the engine's decode steps launched op by op or, with
    `graphs`, replayed from CUDA graphs; with `kv_block_size`, from the block pool (op by op)."""
    from ragcache_integrations.types import ChunkedPrompt

    shape = SHAPES[name]
    folder = model_folder(shape, tokenizer_dir, work / f"model-{name}")
    pool = {"kv_block_size": kv_block_size} if kv_block_size else {}
    engine = engine_on(random_runner(folder, device, dtype), folder, ram_cache_bytes=args.ram_bytes,
                       decode_graphs="on" if graphs else "off", **pool)
    step_floor_s = param_bytes(shape, dtype) / (peaks["bandwidth_gb_s"] * 1e9)
    out: dict[str, Any] = {"tokens_each": args.decode_tokens, "floor_step_ms": round(step_floor_s * 1e3, 3),
                           "graphs": graphs, "kv_block_size": kv_block_size}
    try:
        texts = passages(8, 200, lambda t: engine.tokenizer().encode(t), args.data)
        sampling = {"max_tokens": args.decode_tokens, "ignore_eos": True, "temperature": 0.0}

        def ask(i: int, results: list) -> None:
            results.append(engine.generate(ChunkedPrompt(chunks=[texts[i % len(texts)]], question=f"Summarize ({i})."),
                                           sampling, policy="full"))

        ask(0, [])  # warm-up (and, with graphs, the capture of the one-sequence bucket)
        if device.type == "cuda":  # the GPU's kernels are counted whichever thread launched them
            out["launches_per_token"] = round(launches(device, lambda: ask(0, [])) / args.decode_tokens, 1)
        for clients in args.concurrency:
            results: list = []
            threads = [threading.Thread(target=ask, args=(i, results)) for i in range(clients)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            produced = sum(len(r.token_ids) for r in results)
            out[f"{clients}"] = {"wall_s": round(wall, 3), "output_tokens": produced,
                                 "tokens_per_s": round(produced / wall, 1),
                                 "ttft_p50_s": round(statistics.median(r.stats.ttft_s for r in results), 4),
                                 "floor_tokens_per_s": round(clients / step_floor_s, 1)}
        decoder = engine.decode_graphs()
        if decoder is not None:
            out["graph_replays"] = decoder.replays
            out["graph_buckets"] = sorted(decoder.graphs)
            if decoder.failed:
                out["graph_capture_failed"] = decoder.failed
    finally:
        engine.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def block_pool_guard(runner: Any, tolerance: float) -> dict[str, Any]:
    """Three sequences of different lengths decode four steps from buffers of their own and from
    the same KV moved into a block pool of 4-row blocks (every step crossing some block's edge),
    one of them kept in its buffer beside the pooled ones: the largest logits difference and
    whether every step picked the same tokens."""
    from engine_sidecar.execution.batched_decode import DecodeKV, decode_batch
    from engine_sidecar.execution.block_pool import BlockPool
    from engine_sidecar.execution.kv_buffer import KVBuffer
    from engine_sidecar.execution.paged_kv import PagedKV

    gen = torch.Generator(device=runner.device).manual_seed(1)
    buffers: list[KVBuffer] = []
    for length in (5, 17, 1):
        kv = KVBuffer.allocate(runner, length + len(GUARD_STEPS) + 1)
        for t in (kv.keys_pre, kv.keys, kv.values):
            t.copy_(torch.randn(t.shape, generator=gen, device=runner.device))
        kv.length = length
        buffers.append(kv)
    pool = BlockPool(runner.config, runner.dtype, runner.device, block_size=4, num_blocks=32)
    mixed: list[DecodeKV] = [PagedKV.from_buffer(pool, buffers[0], 16), PagedKV.from_buffer(pool, buffers[1], 32),
                             KVBuffer(buffers[2].keys_pre.clone(), buffers[2].keys.clone(), buffers[2].values.clone(),
                                      buffers[2].length)]
    worst, same = 0.0, True
    for step in GUARD_STEPS:
        reference = decode_batch(runner, list(buffers), step).float()
        got = decode_batch(runner, mixed, step).float()
        worst = max(worst, float((got - reference).abs().max()))
        same = same and bool((got.argmax(-1) == reference.argmax(-1)).all())
    return {"max_abs": worst, "same_tokens": same, "pass": worst <= 4 * tolerance}


def graph_decode_guard(runner: Any, tolerance: float) -> dict[str, Any]:
    """Three sequences of different lengths (one that grows, one of one row; a padded bucket of 4)
    decode four steps op by op and from captured graphs, from the same KV: the largest logits
    difference, and whether the graphs ran at all."""
    from engine_sidecar.execution.batched_decode import decode_batch
    from engine_sidecar.execution.decode_graphs import DecodeGraphs
    from engine_sidecar.execution.kv_buffer import KVBuffer

    gen = torch.Generator(device=runner.device).manual_seed(0)
    eager: list[KVBuffer] = []
    for length, capacity in ((5, 9), (17, 17), (1, 4)):
        kv = KVBuffer.allocate(runner, capacity)
        for t in (kv.keys_pre, kv.keys, kv.values):
            t.copy_(torch.randn(t.shape, generator=gen, device=runner.device))
        kv.length = length
        eager.append(kv)
    replayed = [KVBuffer(kv.keys_pre.clone(), kv.keys.clone(), kv.values.clone(), kv.length) for kv in eager]
    graphs = DecodeGraphs(runner, max_batch=8, max_context=runner.config.max_position_embeddings)
    worst = 0.0
    for step in GUARD_STEPS:
        reference = decode_batch(runner, eager, step).float()
        got = graphs.decode(replayed, step)
        if got is None:
            return {"ran": False, "why": graphs.failed or "no graph served the step", "pass": False}
        worst = max(worst, float((got.float() - reference).abs().max()))
    return {"ran": True, "captured": graphs.capture, "replays": graphs.replays,
            "max_abs": worst, "pass": worst <= 4 * tolerance}
