"""`ragcache bench gpu`'s serve section: a RAG deployment's load on the sidecar's app (in this
process, under uvicorn, around a random-weights engine of the last shape), each policy of
`--serve-policies` side by side on the same requests.

The workload: a corpus of `--serve-corpus` passages of ~`--http-passage-tokens` tokens, warmed into
the engine first, as a deployment with a warm cache would have them. Each request asks
`--serve-passages` of them, drawn Zipf-like (s=1: passage i with weight 1/(i+1), none twice in a
request) in an order of its own, with a new question, and decodes a length drawn uniformly from
`--serve-tokens` past EOS. The request lists come from seeded generators, so every policy sees the
same ones.

Two loads: a closed loop of `--serve-clients` clients sending clients x `--http-requests` requests,
each client its next one as soon as its last is answered; and an open loop, Poisson arrivals at
each of `--serve-rates` requests/s, max(8, 30 s x rate) requests per rate (2 s with --quick), each
sent at its arrival time whether or not the earlier ones finished (ragcache_lab/open_loop.py).

Per row (load, level, policy), from the streamed responses: TTFT p50/p99 (arrival to the first
streamed text), inter-token latency p50/p99 (gaps between streamed text events, each divided by
the request's mean tokens per event, since an event can carry several tokens' text:
closed_loop.RequestTrace.token_gaps), output tokens/s and requests/s over the row's wall time,
requests past the server's request timeout, the chunk hit ratio and reused tokens the responses'
stats report, and the peak KV the engine's running requests held, as its scheduler counts it
(`Engine.stats().kv_rows`, reset per row): rows reserved (prompt + max_tokens + 1 each, what
admission counts; with `--serve-kv-block-size`, the block pool's blocks held) and rows written; on
CUDA also the device's peak allocated memory. Beside the rows, how many such requests fit in the
KV budget at once: as buffers, in the block pool, and in a paged engine admitting by blocks in use
(`requests_that_fit`).

The floor: one decode step reads every weight once (the input embeddings but a row each) and each
running request's keys and values at its context. At the measured copy bandwidth, for the row's
mean number of requests in flight (each one's arrival to end, time-averaged over the wall: with
fewer decoding, or some prefilling, a step yields fewer tokens) at the row's mean context (prompt +
half the answer), that bounds output tokens/s from above; the row prints achieved / that ceiling.
Every layer is taken to attend the whole context, so for a sliding-window family the ceiling is
conservative. The clients run in the server's process: on a small model their parsing shares the
interpreter with the engine.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_sidecar import Engine
from ragcache_lab.closed_loop import ChatRequest, RagcacheTarget, RequestTrace, run_traced
from ragcache_lab.gpu_http import kv_row_bytes, random_engine, server_missing, serving
from ragcache_lab.gpu_models import QUESTION, SHAPES, VOCAB, param_bytes, passages
from ragcache_lab.open_loop import poisson_arrivals, row_stats, run_open, zipf_draw

OPEN_WINDOW_S, QUICK_OPEN_WINDOW_S, OPEN_MIN_REQUESTS = 30.0, 2.0, 8
ZIPF_S = 1.0
PAGED_ENGINE_BLOCK = 16  # vLLM's default block size, for the paged engine's estimate
TEMPLATE_ROWS = 128  # the chat template and the question, over the passages, in a request's KV estimate


def serve_requests(corpus: list[str], count: int, per_request: int, tokens: tuple[int, int],
                   seed: str) -> list[ChatRequest]:
    """`count` requests: `per_request` passages drawn Zipf-like, a question never seen, an output
    length drawn uniformly from `tokens`; the same list for the same seed."""
    rng = random.Random(seed)
    return [ChatRequest(f"{QUESTION} ({seed} {i})",
                        tuple(corpus[j] for j in zipf_draw(rng, len(corpus), per_request, ZIPF_S)),
                        rng.randint(*tokens)) for i in range(count)]


def open_requests(rate: float, quick: bool) -> int:
    """Requests an open-loop rate sends: its window's worth of arrivals, never fewer than 8."""
    return max(OPEN_MIN_REQUESTS, math.ceil(rate * (QUICK_OPEN_WINDOW_S if quick else OPEN_WINDOW_S)))


def decode_floor(shape: dict[str, Any], dtype: torch.dtype, bandwidth_gb_s: float, concurrency: float,
                 context: float) -> dict[str, float]:
    """The step time of the bytes one decode step must read (the weights, and keys and values of
    `concurrency` requests at `context` tokens) at `bandwidth_gb_s`, and the output tokens/s it allows."""
    element = torch.empty((), dtype=dtype).element_size()
    kv_read = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * element
    # a step looks up one embedding row per request, not the whole table (unless the output
    # layer is that table)
    embeddings = 0 if shape.get("tie_word_embeddings") else VOCAB * shape["hidden_size"] * element
    step_s = (param_bytes(shape, dtype) - embeddings + concurrency * context * kv_read) / (bandwidth_gb_s * 1e9)
    return {"floor_step_ms": step_s * 1e3, "floor_tokens_per_s": concurrency / step_s}


def requests_that_fit(shape: dict[str, Any], dtype: torch.dtype, kv_bytes: int, prompt_rows: int,
                      answer: tuple[int, int], block_size: int) -> dict[str, int]:
    """Concurrent requests of `prompt_rows` + an answer in `answer` whose KV fits in `kv_bytes`:
    as buffers (admission reserves prompt + the longest answer + 1 rows of three tensors each); in
    the block pool, which admits by blocks in use, at the mean answer length (two tensors, whole
    blocks of `block_size` rows); and as a paged engine with vLLM's 16-row blocks would hold them
    at the same length: the arithmetic behind "fits beside the model"."""
    element = torch.empty((), dtype=dtype).element_size()
    per_row = shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * element
    reserved = prompt_rows + answer[1] + 1
    mean_rows = prompt_rows + (answer[0] + answer[1]) // 2

    def in_blocks(size: int) -> int:
        return (kv_bytes // (2 * per_row * size)) // -(-mean_rows // size)

    return {"prompt_rows": prompt_rows, "reserved_rows": reserved, "mean_rows": mean_rows, "block_size": block_size,
            "buffers": kv_bytes // (3 * per_row * reserved), "block_pool": in_blocks(block_size),
            "paged_engine_estimate": in_blocks(PAGED_ENGINE_BLOCK)}


@dataclass(frozen=True)
class RowSetting:
    """What every row of a run shares: how its floor and KV are counted, and the server's timeout."""

    shape: dict[str, Any]
    dtype: torch.dtype
    device: torch.device
    bandwidth_gb_s: float
    timeout_s: float


def serve_section(name: str, device: torch.device, dtype: torch.dtype, tokenizer_dir: Path, work: Path,
                  args: argparse.Namespace, peaks: dict[str, float]) -> dict[str, Any]:
    missing = server_missing()
    if missing:
        return {"skipped": missing}
    from engine_sidecar.server.settings import ServerSettings

    lo_hi, max_batch = args.serve_tokens, max(args.serve_clients)
    rows_each = args.serve_passages * (args.http_passage_tokens + 8) + TEMPLATE_ROWS + lo_hi[1] + 1
    opens = {rate: open_requests(rate, args.quick) for rate in args.serve_rates}
    max_queue = max(max_batch, *opens.values()) + 4  # every request of a level admitted: none is a 429
    setting = RowSetting(SHAPES[name], dtype, device, peaks["bandwidth_gb_s"],
                         ServerSettings(max_queue=max_queue).request_timeout_s)  # what serving() runs with
    out: dict[str, Any] = {"corpus": args.serve_corpus, "passages": args.serve_passages,
                           "passage_tokens": args.http_passage_tokens, "tokens": list(lo_hi), "zipf_s": ZIPF_S,
                           "policies": args.serve_policies, "max_batch": max_batch,
                           "request_timeout_s": setting.timeout_s, "rows": []}
    block_size = args.serve_kv_block_size
    with random_engine(name, device, dtype, tokenizer_dir, work, args, max_batch, max_batch * rows_each,
                       block_size) as engine:
        out["batch_kv_gib"] = round(engine.settings().batching.kv_bytes / 2**30, 3)
        out["kv_block_size"] = block_size
        out["fit"] = requests_that_fit(SHAPES[name], dtype, engine.settings().batching.kv_bytes,
                                       rows_each - lo_hi[1] - 1, lo_hi, block_size or 16)
        corpus = passages(args.serve_corpus, args.http_passage_tokens, lambda t: engine.tokenizer().encode(t),
                          args.data)
        engine.warm(corpus)

        def requests(count: int, seed: str) -> list[ChatRequest]:
            return serve_requests(corpus, count, args.serve_passages, lo_hi, seed)

        with serving(engine, max_queue=max_queue) as base:
            targets = {p: RagcacheTarget(base, lo_hi[1], p, ignore_eos=True) for p in args.serve_policies}
            for target in targets.values():  # first-request costs off the clock
                run_traced(target, requests(2, "warm-up"), 1)
            for clients in args.serve_clients:
                asked = requests(clients * args.http_requests, f"closed {clients}")
                for policy, target in targets.items():
                    run = functools.partial(run_traced, target, asked, clients)
                    out["rows"].append(_row("closed", clients, policy, setting, run, engine))
            for rate, count in opens.items():
                asked = requests(count, f"open {rate}")
                offsets = poisson_arrivals(rate, count, random.Random(f"arrivals {rate}"))
                for policy, target in targets.items():
                    run = functools.partial(run_open, target, asked, offsets)
                    out["rows"].append(_row("open", rate, policy, setting, run, engine))
    return out


def _row(mode: str, load: float, policy: str, setting: RowSetting,
         run: Callable[[], tuple[list[RequestTrace], float]], engine: Engine) -> dict[str, Any]:
    """Run one row's load and count what its traces and the engine's KV peaks say, against the floor."""
    shape, device = setting.shape, setting.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine.reset_kv_peaks()
    preempted = engine.stats().preemptions
    traces, wall = run()
    stats = engine.stats()
    kv = stats.kv_rows
    row: dict[str, Any] = {"mode": mode, "load": load, "policy": policy,
                           **row_stats(traces, wall, setting.timeout_s)}
    row_bytes = kv_row_bytes(shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"],
                             setting.dtype)
    if kv.blocks_total:  # a block pool: held is whole blocks of rotated keys and values
        block_bytes = engine.settings().batching.kv_block_size * row_bytes * 2 // 3
        row["peak_kv_blocks"] = kv.peak_blocks_used
        row["preemptions"] = stats.preemptions - preempted
        row["peak_kv_bytes"] = kv.peak_blocks_used * block_bytes
        row["peak_kv_used_bytes"] = kv.peak_used * row_bytes * 2 // 3
    else:
        row["peak_kv_bytes"] = kv.peak_reserved * row_bytes
        row["peak_kv_used_bytes"] = kv.peak_used * row_bytes
    if device.type == "cuda":
        row["peak_device_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    row.update(decode_floor(shape, setting.dtype, setting.bandwidth_gb_s, row["mean_concurrency"],
                            row["mean_context_tokens"]))
    floor = row["floor_tokens_per_s"]
    row["achieved_vs_floor"] = row["output_tokens_per_s"] / floor if floor else None
    return {key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}


def serve_lines(shape: str, value: dict[str, Any]) -> list[str]:
    """The section's markdown: one table row per load, level and policy."""
    if "skipped" in value or "error" in value:
        return [f"Serve, {shape} shape: {'skipped' if 'skipped' in value else 'error'}: "
                f"{(value.get('skipped') or value['error']).splitlines()[0]}", ""]
    lo, hi = value["tokens"]
    lines = [f"Serve, {shape} shape: streamed `/v1/generate`, {value['passages']} of {value['corpus']} warmed "
             f"passages (~{value['passage_tokens']} tokens, Zipf s={value['zipf_s']}) per request, {lo}-{hi} "
             f"tokens each; closed loop (load: clients) and Poisson open loop (load: requests/s); ITL per token, "
             f"peak KV reserved / written by the running requests; ceiling: weights + KV read per step at the copy bandwidth:",
             "", "| load | policy | requests | errors | over timeout | TTFT p50/p99 s | ITL p50/p99 ms | output tok/s "
                 "| req/s | in flight | peak KV GiB | chunk hits | ceiling tok/s | achieved/ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_table_row(r) for r in value["rows"]]
    fit = value.get("fit")
    if fit:
        pool = f"blocks of {value['kv_block_size']} rows" if value.get("kv_block_size") else "buffers (no block pool)"
        lines += ["", f"KV of the running requests: {value['batch_kv_gib']} GiB, held as {pool}. Requests of "
                      f"{fit['prompt_rows']} prompt rows that fit in it at once: {fit['buffers']} as buffers "
                      f"({fit['reserved_rows']} rows of three tensors each), {fit['block_pool']} in the block pool "
                      f"and {fit['paged_engine_estimate']} in a paged engine with 16-row blocks (both admit by "
                      f"blocks in use: {fit['mean_rows']} rows of two tensors at the mean answer, in whole "
                      f"blocks of {fit['block_size']} and 16)."]
    errors = [f"{_load(r)} {r['policy']}: {r['first_error']}" for r in value["rows"] if r["first_error"]]
    return lines + ([""] + [f"First error, {e}" for e in errors] if errors else []) + [""]


def _table_row(r: dict[str, Any]) -> str:
    cells = [_load(r), r["policy"], r["requests"], r["errors"], r["over_timeout"],
             f"{_fmt(r['ttft_p50_s'], 4)}/{_fmt(r['ttft_p99_s'], 4)}",
             f"{_fmt(r['itl_p50_ms'])}/{_fmt(r['itl_p99_ms'])}",
             round(r["output_tokens_per_s"], 1), round(r["requests_per_s"], 2), round(r["mean_concurrency"], 1),
             f"{r['peak_kv_bytes'] / 2**30:.3g}/{r['peak_kv_used_bytes'] / 2**30:.3g}",
             f"{round(r['chunk_hit_ratio'] * 100)}%",
             round(r["floor_tokens_per_s"], 1), _fmt(r["achieved_vs_floor"], 3)]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _load(row: dict[str, Any]) -> str:
    return f"{row['load']} clients" if row["mode"] == "closed" else f"{row['load']:g}/s open"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else str(round(value, digits))
