"""`ragcache bench gpu`: the engine on an accelerator in one command, beside its physical floors.

Sections, each written to the JSON as soon as it finishes (a failing one records its error and
the others still run):

- **kernels**: Triton vs torch reference at production shapes (max abs difference), and their
  timings (`ragcache_kernels.bench`); CUDA only.
- **guards**: a small random Llama saved as a real model folder and loaded the normal way:
  `full` prefill vs transformers, `cacheblend:1.0` vs `full`, and on CUDA the engine with Triton
  kernels vs torch kernels (logits max abs difference, argmax agreement).
- **ttft**: per model shape (Llama-3.2-1B, Llama-3-8B; random weights made on the device, since
  speed does not depend on weight values), `--passages` stored passages of ~`--passage-tokens`
  each, asked in a new order with a new question; the median TTFT per policy after warm-ups,
  transformers' full prefill (sdpa) of the same length beside, and the floors: the weights read
  once at the measured memory bandwidth, and the prefill's FLOPs at the measured matmul peak.
- **decode**: output tokens/s at 1, 8 and 32 concurrent requests (`ignore_eos`), with the floor
  one batched step costs (weights read once per step).
- **http**: the sidecar's app in this process, closed-loop clients streaming over HTTP at
  `--http-clients` concurrencies (ragcache_lab/gpu_http.py): TTFT p50/p99 and output tokens/s.
- **serve**: a RAG deployment's load on the same server (ragcache_lab/gpu_serve.py): a warmed
  corpus, Zipf-drawn passages per request, closed-loop clients and Poisson open-loop arrivals,
  each `--serve-policies` policy side by side: TTFT and inter-token latency p50/p99, tokens/s and
  requests/s, peak KV, chunk hit ratio, and the decode bandwidth ceiling at the row's concurrency.
- **tiles**: the selective attention at each candidate tile against the launch the engine makes
  (ragcache_lab/gpu_tiles.py); CUDA only, last because its compiles take the longest.

Peaks are measured on the machine (a large device copy; a large bf16/fp32 matmul), not taken from
a datasheet. `--device cpu --quick` is a dry run with tiny shapes (a CI test runs it).
Needs torch and transformers (reference only); runs without rich, and without fastapi/uvicorn
but for the http and serve sections, which then say what is missing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine_sidecar.execution.prefill_graphs import PrefillGraphs, load_first_layers
from ragcache_lab.gpu_counts import (
    first_sync_stack,
    host_sync_sites,
    host_syncs,
    launches,
    profile_tables,
    site_counts,
    sync,
)
from ragcache_lab.gpu_decode import block_pool_guard, decode_section, graph_decode_guard
from ragcache_lab.gpu_http import http_section
from ragcache_lab.gpu_models import (
    GUARD_SHAPES,
    QUESTION,
    SHAPES,
    engine_on,
    hf_reference,
    model_folder,
    param_bytes,
    passages,
    prefill_flops,
    random_runner,
)
from ragcache_lab.gpu_serve import serve_lines, serve_section
from ragcache_lab.gpu_tiles import tile_lines, tile_sweep

BLOCK_POOL_ROWS = 16  # the decode section's block-pool run: vLLM's default block size
SECTIONS = ("kernels", "guards", "ttft", "decode", "http", "serve", "tiles")  # gpu_args.SECTION_NAMES
POLICIES = ("full", "reuse", "cacheblend:0.15", "cacheblend", "epic:16", "cachecraft:1")
# measured again with --prefill-graphs on, on the same prompts (on a CPU nothing replays: the rows
# show what the op-by-op path costs, with graph_replays 0)
GRAPH_POLICIES = ("reuse", "cacheblend:0.15", "cacheblend", "epic:16")
GRAPHS_SUFFIX = "+graphs"


# --- the machine -----------------------------------------------------------------------------------
def describe_machine(device: torch.device) -> dict[str, Any]:
    # the kernel's release names the machine's runtime too (gVisor reports 4.4.0): a launch's host
    # cost differs between runtimes
    info: dict[str, Any] = {"device": device.type, "torch": torch.__version__, "python": platform.python_version(),
                            "kernel": platform.release()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    else:
        try:
            text = Path("/proc/cpuinfo").read_text()
            info["name"] = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                                if line.startswith("model name"))
            flags = next(line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags"))
            info["cpu_flags"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        except (OSError, StopIteration):
            info["name"] = platform.processor() or "cpu"
        info["threads"] = torch.get_num_threads()
    return info


def timed(device: torch.device, fn: Callable[[], Any], repeats: int, warmups: int = 2) -> float:
    """Median seconds of `fn` (synchronized), after warm-ups."""
    for _ in range(warmups):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_peaks(device: torch.device, dtype: torch.dtype, quick: bool) -> dict[str, float]:
    """Memory bandwidth (a device copy: read + write) and the matmul peak, measured here."""
    n_bytes = (64 if quick else 1024) << 20
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = timed(device, lambda: dst.copy_(src), 3 if quick else 10)
    size = 512 if quick else 8192
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    mm_s = timed(device, lambda: a @ b, 3 if quick else 10)
    return {"bandwidth_gb_s": round(2 * n_bytes / copy_s / 1e9, 1), "matmul_tflop_s": round(2 * size**3 / mm_s / 1e12, 2)}


def transformers_prefill_s(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, tokens: int,
                           repeats: int) -> float:
    """Median seconds of transformers' full prefill of `tokens` random ids (the last token's logits)."""
    model = hf_reference(shape, device, dtype)
    ids = torch.randint(0, 49152, (1, tokens), device=device)
    with torch.no_grad():
        seconds = timed(device, lambda: model(ids, logits_to_keep=1), repeats)
    model = None  # its memory back before the next model is made
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


# --- sections -----------------------------------------------------------------------------------------
def kernels_section(device: torch.device, quick: bool) -> dict[str, Any]:
    from ragcache_kernels import bench as kernel_bench
    from ragcache_kernels import dispatch
    from ragcache_kernels.rope import inv_frequencies

    if device.type != "cuda" or not dispatch.triton_available():
        return {"skipped": "Triton kernels run on CUDA only; on the CPU the torch references run"}
    out: dict[str, Any] = {"max_abs_diff": {}}
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        # 15% of a 6.2K-token prompt recomputed; a reuse request's question rows (few queries
        # over every key: the keys are split across programs); a short dense prompt
        for heads, kv_heads, dim, keys, queries in ((32, 8, 128, 6231, 934), (32, 8, 64, 6231, 934),
                                                    (32, 8, 128, 6231, 38), (32, 32, 128, 513, 513)):
            pos = torch.arange(keys, device=device)
            picked = torch.randperm(keys, generator=gen)[:queries].sort().values.to(device)
            q, k, v = (torch.randn(n, h, dim, generator=gen).to(device, dtype)
                       for n, h in ((queries, heads), (keys, kv_heads), (keys, kv_heads)))
            name = f"{str(dtype).removeprefix('torch.')} h{heads}/{kv_heads} d{dim} keys {keys} queries {queries}"
            a = dispatch.selective_attention(q, k, v, pos[picked], pos, backend="torch")
            b = dispatch.selective_attention(q, k, v, pos[picked], pos, backend="triton")
            out["max_abs_diff"][f"attention {name}"] = float((a.float() - b.float()).abs().max())
            inv = inv_frequencies(dim, 5e5).to(device)
            a = dispatch.rotate_keys(k, pos, inv, backend="torch")
            b = dispatch.rotate_keys(k, pos, inv, backend="triton")
            out["max_abs_diff"][f"rope {name}"] = float((a.float() - b.float()).abs().max())
    out["few_queries_split_keys"] = few_queries_split(device, quick)
    out["batched_decode_layer"] = batched_decode_bench(device, quick)
    args = argparse.Namespace(model="llama8b", tokens=512 if quick else 8192, ratio=0.15, chunks=8, dtype="bfloat16",
                              device=device.type, warmup=3, repeats=20, out=None)
    out["timings"] = [{k: r[k] for k in ("op", "impl", "shape", "ms", "speedup_vs_reference")}
                      for r in kernel_bench.run(args)["results"]]
    return out


def few_queries_split(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    """The Triton selective attention with the keys in one program per query block and head
    against split across programs (its default when queries are few), 8B shape, bf16."""
    from ragcache_kernels import triton_attention

    gen = torch.Generator().manual_seed(2)
    rows: list[dict[str, Any]] = []
    for keys, queries in ((6231, 38), (6231, 1), (1024 if quick else 16384, 38)):
        pos = torch.arange(keys, device=device)
        picked = pos[-queries:]  # the question at the end of the prompt
        q = torch.randn(queries, 32, 128, generator=gen).to(device, torch.bfloat16)
        k, v = (torch.randn(keys, 8, 128, generator=gen).to(device, torch.bfloat16) for _ in range(2))
        times = {}
        for label, splits in (("one split", 1), ("split keys", None)):
            call = functools.partial(triton_attention.selective_attention, q, k, v, picked, pos, splits=splits)
            times[label] = timed(device, call, 5 if quick else 50) * 1e3
        rows.append({"keys": keys, "queries": queries, "one_split_ms": round(times["one split"], 4),
                     "split_keys_ms": round(times["split keys"], 4),
                     "speedup": round(times["one split"] / times["split keys"], 2)})
    return rows


def _decode_layer_each(kvs: list, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
    from engine_sidecar.execution.batched_decode import attend_each

    return attend_each(0, kvs, [kv.length for kv in kvs], None, q, k_new, k_new, v_new)


def _decode_layer_batched(kvs: list, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
    from ragcache_kernels import dispatch

    step = dispatch.batched_decode([kv.keys_pre for kv in kvs], [kv.keys for kv in kvs], [kv.values for kv in kvs],
                                   [kv.length for kv in kvs], backend="triton")
    assert step is not None
    step.append(0, k_new, k_new, v_new)
    return step.attend(0, q)


def batched_decode_bench(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    """One decode layer of B sequences (8B shape, bf16, ~6.2K keys each): the new rows written and
    attended sequence by sequence (torch) against the Triton batched kernels (one launch each)."""
    from engine_sidecar.execution.kv_buffer import KVBuffer

    gen = torch.Generator().manual_seed(3)
    rows: list[dict[str, Any]] = []
    keys = 64 if quick else 6231
    for batch in (1, 4) if quick else (1, 8, 32):
        kvs = [KVBuffer(*(torch.randn(1, keys + 1, 8, 128, generator=gen).to(device, torch.bfloat16)
                          for _ in range(3)), length=keys - i) for i in range(batch)]
        q = torch.randn(batch, 32, 128, generator=gen).to(device, torch.bfloat16)
        k_new, v_new = (torch.randn(batch, 8, 128, generator=gen).to(device, torch.bfloat16) for _ in range(2))
        each = functools.partial(_decode_layer_each, kvs, q, k_new, v_new)
        batched = functools.partial(_decode_layer_batched, kvs, q, k_new, v_new)
        diff = float((each().float() - batched().float()).abs().max())
        repeats, warmups = (1, 0) if quick else (50, 2)
        each_ms = timed(device, each, repeats, warmups) * 1e3
        batched_ms = timed(device, batched, repeats, warmups) * 1e3
        rows.append({"sequences": batch, "keys": keys, "max_abs_diff": round(diff, 5),
                     "per_sequence_ms": round(each_ms, 4), "batched_ms": round(batched_ms, 4),
                     "speedup": round(each_ms / batched_ms, 2)})
    return rows


def guards_section(device: torch.device, dtype: torch.dtype, tokenizer_dir: Path, work: Path,
                   data: Path | None) -> dict[str, Any]:
    """Correctness on this device and dtype, on real (saved and loaded) small random models of each
    family; the kernels, graphs and tiers on the Llama one."""
    tolerance = 2e-3 if dtype == torch.float32 else 0.1
    engine, out, reordered = family_guard(GUARD_SHAPES["llama"], device, dtype, tokenizer_dir, work / "guard-model",
                                          data, tolerance)
    try:
        if device.type == "cuda":
            previous = os.environ.get("RAGCACHE_KERNELS")
            try:
                os.environ["RAGCACHE_KERNELS"] = "torch"
                torch_logits, _ = engine.prefill_logits(reordered, policy="cacheblend:0.15")
                os.environ["RAGCACHE_KERNELS"] = "triton"
                triton_logits, _ = engine.prefill_logits(reordered, policy="cacheblend:0.15")
            finally:
                os.environ.pop("RAGCACHE_KERNELS", None) if previous is None else os.environ.update(
                    RAGCACHE_KERNELS=previous)
            out["triton_vs_torch_engine_max_abs"] = float((torch_logits.float() - triton_logits.float()).abs().max())
            out["graph_decode"] = graph_decode_guard(engine.model_runner(), tolerance)
            out["graph_prefill"] = graph_prefill_guard(engine, reordered, tolerance)
        out["block_pool_decode"] = block_pool_guard(engine.model_runner(), tolerance)
        out["tiers"] = tier_round_trip(device, dtype, work)
    finally:
        engine.close()
    # the other families: full prefill vs transformers and ratio 1.0 vs full on this device
    out["families"] = {}
    for family, shape in GUARD_SHAPES.items():
        if family != "llama":
            other, row, _ = family_guard(shape, device, dtype, tokenizer_dir, work / f"guard-{family}", data,
                                         tolerance)
            other.close()
            out["families"][family] = row
    out["pass"] = (out["full_vs_transformers_max_abs"] <= tolerance and out["cacheblend1_vs_full_max_abs"] <= tolerance
                   and out.get("triton_vs_torch_engine_max_abs", 0.0) <= 4 * tolerance and out["tiers"]["pass"]
                   and out.get("graph_decode", {}).get("pass", True)
                   and out.get("graph_prefill", {}).get("pass", True)
                   and out["block_pool_decode"]["pass"]
                   and all(row["pass"] for row in out["families"].values()))
    return out


def family_guard(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, tokenizer_dir: Path,
                 folder: Path, data: Path | None, tolerance: float) -> tuple[Any, dict[str, Any], Any]:
    """A small random model of `shape`'s family saved as transformers saves it and loaded by the
    engine: its full prefill against transformers' and CacheBlend at 1.0 against full on reordered
    stored passages. Returns the open engine, the row and the reordered prompt."""
    from engine_sidecar.engine.engine import Engine
    from ragcache_integrations.types import ChunkedPrompt

    model_folder(shape, tokenizer_dir, folder)
    reference = hf_reference(shape, torch.device("cpu"), torch.float32)
    reference.save_pretrained(str(folder))  # real weights in the folder: the engine loads them as any model
    engine = Engine.from_pretrained(folder, device=device.type, dtype=str(dtype).removeprefix("torch."), disk=False)
    chunks = passages(4, 120, lambda t: engine.tokenizer().encode(t), data)
    prompt = ChunkedPrompt(chunks=chunks, question=QUESTION)
    full, _ = engine.prefill_logits(prompt, policy="full")
    ids = torch.tensor([engine.prompt_token_ids(prompt)], device=device)
    reference = reference.to(device=device, dtype=dtype)
    with torch.no_grad():
        hf = reference(ids, logits_to_keep=1).logits[0, -1]
    del reference
    engine.warm(chunks)
    reordered = ChunkedPrompt(chunks=chunks[::-1], question=QUESTION)
    ref_logits, _ = engine.prefill_logits(reordered, policy="full")
    blend, _ = engine.prefill_logits(reordered, policy="cacheblend:1.0")
    row: dict[str, Any] = {
        "full_vs_transformers_max_abs": float((full.float() - hf.float()).abs().max()),
        "full_vs_transformers_argmax_equal": int(full.argmax()) == int(hf.argmax()),
        "cacheblend1_vs_full_max_abs": float((blend.float() - ref_logits.float()).abs().max()),
        "tolerance": tolerance,
    }
    row["pass"] = row["full_vs_transformers_max_abs"] <= tolerance and row["cacheblend1_vs_full_max_abs"] <= tolerance
    return engine, row, reordered


def graph_prefill_guard(engine, prompt, tolerance: float) -> dict[str, Any]:
    """Prefills whose layers after the policy's last choice replay from captured graphs against the
    same prefills op by op: logits apart by at most `tolerance` with the same next token, a second
    replay equal to the first, and graphs really captured and replayed."""
    graphs = PrefillGraphs(engine.model_runner(), engine.max_context)
    own = engine.use_prefill_graphs(None)  # the engine's own, by its --prefill-graphs: set aside
    out: dict[str, Any] = {}
    for policy in GRAPH_POLICIES[:2]:
        engine.use_prefill_graphs(None)
        try:
            eager, _ = engine.prefill_logits(prompt, policy=policy)
            replays = graphs.replays
            engine.use_prefill_graphs(graphs)
            graphed, _ = engine.prefill_logits(prompt, policy=policy)
            again, _ = engine.prefill_logits(prompt, policy=policy)
        finally:
            engine.use_prefill_graphs(own)
        out[policy] = {"max_abs": float((graphed.float() - eager.float()).abs().max()),
                       "argmax_equal": int(graphed.argmax()) == int(eager.argmax()),
                       "replays": graphs.replays - replays, "second_replay_equal": bool(torch.equal(graphed, again))}
    out["captured"] = bool(graphs.graphs) and all(g.graph is not None for g in graphs.graphs.values())
    out["capture_failed"] = graphs.failed
    out["pass"] = out["captured"] and all(
        r["max_abs"] <= tolerance and r["argmax_equal"] and r["replays"] == 2 and r["second_replay_equal"]
        for r in (out[p] for p in GRAPH_POLICIES[:2]))
    return out


def tier_round_trip(device: torch.device, dtype: torch.dtype, work: Path) -> dict[str, Any]:
    """The store's moves on this device: an entry device memory evicts comes back from the host
    tier bit for bit, the disk tier's file (written from the side stream's host copy) holds it bit
    for bit, and the read back from the host makes the host wait for nothing (on CUDA). The first
    such read in a process waits once (CUDA's one-time set-up of that copy path), so the waits are
    counted on a second store's read, the first's reported beside them."""
    from engine_sidecar.store.chunk_store import ChunkStore
    from engine_sidecar.store.entry import CacheKey, ChunkKV

    shape = (4, 256, 8, 64)

    def entry(seed: int) -> ChunkKV:
        gen = torch.Generator().manual_seed(seed)
        return ChunkKV(torch.randn(shape, generator=gen).to(device, dtype),
                       torch.randn(shape, generator=gen).to(device, dtype), torch.arange(shape[1]), f"c{seed}")

    def key(seed: int) -> CacheKey:
        return CacheKey("bench", "bench", f"tokens-{seed}", "", "isolated")

    one = entry(0).nbytes

    def filled_store(folder: str) -> ChunkStore:
        store = ChunkStore(one, work / folder, device, disk_capacity_bytes=0, host_capacity_bytes=4 * one)
        store.put(key(1), entry(1))
        store.put(key(2), entry(2))  # device memory holds one entry: the first moves to the host tier
        return store

    def read_sites(store: ChunkStore, found: list) -> list[str]:
        if device.type != "cuda":
            found.append(store.get(key(1)))
            return []
        return host_sync_sites(lambda: found.append(store.get(key(1))))

    first = entry(1)
    expected = first.keys.clone().cpu(), first.values.clone().cpu()
    first_read = filled_store("tier-kv-first")
    first_sites = read_sites(first_read, [])
    first_read.flush()
    store = filled_store("tier-kv")
    found: list[ChunkKV | None] = []
    sites = read_sites(store, found)
    stack = None
    if sites:  # the same read on a store of its own, stopped at its first wait: the calls that led there
        other = filled_store("tier-kv-stack")
        stack = first_sync_stack(lambda: other.get(key(1)))
        other.flush()
    back = found[0]
    store.flush()
    assert store.disk is not None
    on_disk = store.disk.get(key(1).digest)
    stats = store.stats()
    out = {"host_hits": stats.hits_host, "host_demotions": stats.host_demotions, "host_read_syncs": len(sites),
           "host_read_sync_sites": site_counts(sites), "host_read_sync_stack": stack,
           "first_read_in_process_syncs": len(first_sites), "first_read_sync_sites": site_counts(first_sites),
           "host_round_trip_equal": back is not None and back.keys.device.type == device.type
           and torch.equal(back.keys.cpu(), expected[0]) and torch.equal(back.values.cpu(), expected[1]),
           "disk_copy_equal": on_disk is not None and torch.equal(on_disk.keys.cpu(), expected[0])
           and torch.equal(on_disk.values.cpu(), expected[1])}
    out["pass"] = bool(out["host_round_trip_equal"] and out["disk_copy_equal"] and not sites
                       and stats.hits_host == 1)
    return out


HOST_TIER_ROW = "reuse (host tier)"


def profile_policies(engine, stored: list[str], device: torch.device, args: argparse.Namespace, shape: str,
                     graphs: PrefillGraphs | None = None) -> None:
    """For each policy of `--profile`, one request through torch.profiler (operators) and cProfile
    (Python functions), into profile-SHAPE.txt beside the JSON; with `graphs`, the policies of
    GRAPH_POLICIES again with their layers replayed (appended, marked +graphs)."""
    from ragcache_integrations.types import ChunkedPrompt

    wanted = [p.strip() for p in getattr(args, "profile", "").split(",") if p.strip()]
    if graphs is not None:
        wanted = [p for p in wanted if p in GRAPH_POLICIES]
    if not wanted:
        return
    parts = []
    for i, policy in enumerate(wanted):
        prompt = ChunkedPrompt(chunks=stored[i:] + stored[:i], question=f"{QUESTION} (profiled {i})")
        label = f"{policy}{' ' + GRAPHS_SUFFIX if graphs else ''}"
        trace = args.out / "traces" / f"{shape}-{label.replace(' ', '').replace(':', '_').replace('+', '-')}.json"
        table = profile_tables(device, lambda p=prompt, pol=policy: engine.prefill_logits(p, policy=pol),
                               trace=trace if device.type == "cuda" else None)
        parts.append(f"=== {label}, {shape} shape\n{table}")
    path = args.out / f"profile-{shape}.txt"
    earlier = path.read_text() + "\n" if graphs is not None and path.exists() else ""
    path.write_text(earlier + "\n\n".join(parts) + "\n")


def reuse_from_host_tier(engine, stored: list[str], device: torch.device, repeats: int) -> dict[str, Any]:
    """`reuse` with every stored passage in the host tier and none in device memory: each request
    copies them back (what a device tier smaller than the working set costs). The engine's tiers
    are swapped for the measurement and put back after it."""
    from engine_sidecar.store.ram import RamTier
    from ragcache_integrations.types import ChunkedPrompt

    store = engine.chunk_store()
    device_tier, host_tier = store.ram, store.host
    store.host = RamTier(1 << 50)
    for digest, entry in device_tier.items():
        store.host.put(digest, store.copies.to_host(entry))
    store.ram = RamTier(0)  # keeps nothing: a hit copies from the host every time
    try:
        prompt = ChunkedPrompt(chunks=stored[::-1], question=f"{QUESTION} (host tier)")
        seconds = timed(device, lambda: engine.prefill_logits(prompt, policy="reuse")[0].float().sum(), repeats)
        hits_before = store.hits_host
        _, stats = engine.prefill_logits(prompt, policy="reuse")
        row = {"ttft_ms": round(seconds * 1e3, 2), "computed_fraction": round(stats.computed_fraction, 3),
               "chunk_hits": stats.chunk_hits, "host_tier_hits": store.hits_host - hits_before}
        if device.type == "cuda":
            row["host_syncs"] = host_syncs(lambda: engine.prefill_logits(prompt, policy="reuse"))
        return row
    finally:
        store.ram, store.host = device_tier, host_tier


def policy_row(engine, prompt, policy: str, device: torch.device, repeats: int) -> dict[str, Any]:
    """One policy's median TTFT on `prompt`, its computed share, hits, launches and host syncs."""
    seconds = timed(device, lambda: engine.prefill_logits(prompt, policy=policy)[0].float().sum(), repeats)
    _, stats = engine.prefill_logits(prompt, policy=policy)
    row = {"ttft_ms": round(seconds * 1e3, 2), "computed_fraction": round(stats.computed_fraction, 3),
           "chunk_hits": stats.chunk_hits, "tokens": stats.prefill_tokens_total,
           "launches": launches(device, lambda: engine.prefill_logits(prompt, policy=policy))}
    if device.type == "cuda":
        sites = host_sync_sites(lambda: engine.prefill_logits(prompt, policy=policy))
        row.update(host_syncs=len(sites), host_sync_sites=site_counts(sites))
    return row


def ttft_section(name: str, device: torch.device, dtype: torch.dtype, tokenizer_dir: Path, work: Path,
                 args: argparse.Namespace, peaks: dict[str, float]) -> dict[str, Any]:
    from ragcache_integrations.types import ChunkedPrompt

    shape = SHAPES[name]
    folder = model_folder(shape, tokenizer_dir, work / f"model-{name}")
    # op by op whatever the default: the +graphs rows below replay the same prompts
    engine = engine_on(random_runner(folder, device, dtype), folder, ram_cache_bytes=args.ram_bytes,
                       prefill_graphs="off")
    try:
        stored = passages(args.passages, args.passage_tokens, lambda t: engine.tokenizer().encode(t), args.data)
        engine.warm(stored)
        rows: dict[str, Any] = {}
        tokens = 0

        def prompt_for(i: int) -> ChunkedPrompt:
            # the stored passages in a new order (no exact prefix), a question never seen
            order = stored[i % len(stored):] + stored[: i % len(stored)]
            return ChunkedPrompt(chunks=order[::-1] if i % 2 else order, question=f"{QUESTION} ({i})")

        for i, policy in enumerate(POLICIES):
            rows[policy] = policy_row(engine, prompt_for(i), policy, device, args.repeats)
            tokens = rows[policy].pop("tokens")
        profile_policies(engine, stored, device, args, name)
        # the same prompts again, their layers after the policy's last choice replayed from graphs,
        # captured first as the engine does at load
        graphs = PrefillGraphs(engine.model_runner(), engine.max_context)
        captured, capture_s = graphs.capture_all(load_first_layers(engine.num_layers))
        capture = {"graphs": captured, "seconds": round(capture_s, 2), "timed": graphs.summary(tokens)}
        if graphs.failed:
            capture["failed"] = graphs.failed
        engine.use_prefill_graphs(graphs)
        try:
            for policy in GRAPH_POLICIES:
                replays, launched = graphs.replays, graphs.launched
                row = policy_row(engine, prompt_for(POLICIES.index(policy)), policy, device, args.repeats)
                row.pop("tokens")
                row["graph_replays"] = graphs.replays - replays
                row["graph_op_by_op"] = graphs.launched - launched  # a graph served it, op by op was faster
                if graphs.failed:
                    row["graph_capture_failed"] = graphs.failed
                rows[f"{policy} {GRAPHS_SUFFIX}"] = row
            profile_policies(engine, stored, device, args, name, graphs)
        finally:
            engine.use_prefill_graphs(None)
        rows[HOST_TIER_ROW] = reuse_from_host_tier(engine, stored, device, args.repeats)
    finally:
        engine.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hf_s = transformers_prefill_s(shape, device, dtype, tokens, args.repeats)
    full = rows["full"]["ttft_ms"]
    for row in rows.values():
        row["speedup_vs_full"] = round(full / row["ttft_ms"], 2)
    weights_ms = param_bytes(shape, dtype) / (peaks["bandwidth_gb_s"] * 1e9) * 1e3
    return {"tokens": tokens, "policies": rows, "prefill_graph_capture": capture,
            "transformers_full_ms": round(hf_s * 1e3, 2),
            "full_vs_transformers": round(full / (hf_s * 1e3), 2),
            "floor_weights_read_ms": round(weights_ms, 3),
            "floor_full_prefill_ms": round(prefill_flops(shape, tokens) / (peaks["matmul_tflop_s"] * 1e12) * 1e3, 2)}


# --- the command ------------------------------------------------------------------------------------
def run_gpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[
        args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")]
    shapes = args.shapes
    tokenizer_dir = args.tokenizer or _default_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": describe_machine(device), "dtype": str(dtype).removeprefix("torch."),
                              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                         if k != "func"}, "seconds": {}}

    def section(key: str, fn: Callable[[], Any]) -> Any:
        print(f"== {key}", flush=True)
        started = time.perf_counter()
        try:
            report[key] = fn()
        except Exception as exc:  # noqa: BLE001 - one failing section must not lose the others
            traceback.print_exc()
            report[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        report["seconds"][key] = round(time.perf_counter() - started, 1)
        write(args.out, report)
        return report[key]

    wanted = set(getattr(args, "sections", SECTIONS))
    with tempfile.TemporaryDirectory(prefix="ragcache-bench-gpu-") as tmp:
        work = Path(tmp)
        peaks = section("peaks", lambda: measure_peaks(device, dtype, args.quick))
        if "kernels" in wanted:
            section("kernels", lambda: kernels_section(device, args.quick))
        if "guards" in wanted:
            section("guards", lambda: guards_section(device, dtype, tokenizer_dir, work, args.data))
        for name in shapes if "ttft" in wanted else ():
            section(f"ttft_{name}", lambda n=name: ttft_section(n, device, dtype, tokenizer_dir, work, args, peaks))
        if "decode" in wanted:
            section(f"decode_{shapes[-1]}", lambda: decode_section(shapes[-1], device, dtype, tokenizer_dir, work,
                                                                   args, peaks, graphs=False))
            if device.type == "cuda":
                section(f"decode_{shapes[-1]}_graphs", lambda: decode_section(shapes[-1], device, dtype, tokenizer_dir,
                                                                              work, args, peaks, graphs=True))
            section(f"decode_{shapes[-1]}_block_pool", lambda: decode_section(
                shapes[-1], device, dtype, tokenizer_dir, work, args, peaks, kv_block_size=BLOCK_POOL_ROWS))
        if args.http_clients and "http" in wanted:
            section(f"http_{shapes[-1]}", lambda: http_section(shapes[-1], device, dtype, tokenizer_dir, work, args))
        if "serve" in wanted:
            section(f"serve_{shapes[-1]}", lambda: serve_section(shapes[-1], device, dtype, tokenizer_dir, work, args,
                                                                 peaks))
        if device.type == "cuda" and "tiles" in wanted:
            # last: each tile compiles twice (with and without split keys), the run's longest wait
            section("tiles", lambda: tile_sweep(device, args.quick, timed))
    write(args.out, report)
    print(markdown(report))
    return report


def _default_tokenizer() -> Path:
    from engine_sidecar.model.prepare import resolve_model_dir

    return resolve_model_dir("default")


def write(out: Path, report: dict[str, Any]) -> None:
    (out / "bench-gpu.json").write_text(json.dumps(report, indent=1))
    (out / "bench-gpu.md").write_text(markdown(report) + "\n")


def _tiers_line(tiers: dict[str, Any]) -> str:
    if not tiers:
        return "tiers not run"
    return (f"host tier round trip {'exact' if tiers['host_round_trip_equal'] else 'DIFFERS'}, disk copy "
            f"{'exact' if tiers['disk_copy_equal'] else 'DIFFERS'}, {tiers['host_read_syncs']} host syncs reading back")


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    where = m.get("name", m["device"]) + (f" ({', '.join(m['cpu_flags'])})" if m.get("cpu_flags") else "")
    kernel = f", Linux {m['kernel']}" if m.get("kernel") else ""
    lines = [f"`ragcache bench gpu` on {where}, torch {m['torch']}, Triton {m.get('triton')}, {report['dtype']}{kernel}",
             ""]
    peaks = report.get("peaks", {})
    if "bandwidth_gb_s" in peaks:
        lines += [f"Measured peaks: copy bandwidth {peaks['bandwidth_gb_s']} GB/s, matmul "
                  f"{peaks['matmul_tflop_s']} TFLOP/s.", ""]
    guards = report.get("guards", {})
    if "pass" in guards:
        lines += [f"Guards: {'pass' if guards['pass'] else 'FAIL'} (full vs transformers "
                  f"{guards['full_vs_transformers_max_abs']:.4g}, cacheblend:1.0 vs full "
                  f"{guards['cacheblend1_vs_full_max_abs']:.4g}"
                  + (f", Triton vs torch engine {guards['triton_vs_torch_engine_max_abs']:.4g}"
                     if "triton_vs_torch_engine_max_abs" in guards else "")
                  + (", prefill graphs vs op by op " + ", ".join(
                      f"{p} {guards['graph_prefill'][p]['max_abs']:.4g}" for p in GRAPH_POLICIES[:2]
                      if p in guards["graph_prefill"]) if "graph_prefill" in guards else "")
                  + (f", block-pool decode vs buffers {guards['block_pool_decode']['max_abs']:.4g}"
                     if "block_pool_decode" in guards else "")
                  + f"; tolerance {guards['tolerance']}; "
                  + _tiers_line(guards.get("tiers", {})) + ")", ""]
        families = guards.get("families", {})
        if families:
            lines += ["Other families (full vs transformers, cacheblend:1.0 vs full): " + "; ".join(
                f"{name} {'pass' if row['pass'] else 'FAIL'} {row['full_vs_transformers_max_abs']:.4g}, "
                f"{row['cacheblend1_vs_full_max_abs']:.4g}" for name, row in families.items()), ""]
    split = report.get("kernels", {}).get("few_queries_split_keys")
    if split:
        lines += ["Selective attention, few queries (8B heads, bf16; ms):", "",
                  "| keys | queries | one split per query block | keys split | speed-up |", "|---|---|---|---|---|"]
        lines += [f"| {r['keys']} | {r['queries']} | {r['one_split_ms']} | {r['split_keys_ms']} | {r['speedup']}× |"
                  for r in split]
        lines.append("")
    if isinstance(report.get("tiles"), list):
        lines += tile_lines(report["tiles"])
    decode_layer = report.get("kernels", {}).get("batched_decode_layer")
    if decode_layer:
        lines += ["Decode attention, one layer (8B heads, bf16; ms): new rows written and attended per sequence "
                  "(torch) vs the Triton batched kernels:", "",
                  "| sequences | keys each | per sequence | batched | speed-up | max abs diff |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['sequences']} | {r['keys']} | {r['per_sequence_ms']} | {r['batched_ms']} | {r['speedup']}× | "
                  f"{r['max_abs_diff']} |" for r in decode_layer]
        lines.append("")
    for key, value in report.items():
        if key.startswith("ttft_") and "policies" in value:
            lines += _ttft_lines(key[5:], value, report["machine"]["device"])
        elif key.startswith("decode_") and "tokens_each" in value:
            how = "replayed from CUDA graphs" if value.get("graphs") else "launched op by op"
            if value.get("kv_block_size"):
                how += f", KV in a block pool of {value['kv_block_size']}-row blocks"
            shape = key[7:].removesuffix("_graphs").removesuffix("_block_pool")
            lines += [f"Decode, {shape} shape, {value['tokens_each']} tokens each, {how}:",
                      "", "| concurrent | tokens/s | floor tokens/s | TTFT p50 s |", "|---|---|---|---|"]
            lines += [f"| {c} | {r['tokens_per_s']} | {r['floor_tokens_per_s']} | {r['ttft_p50_s']} |"
                      for c, r in value.items() if isinstance(r, dict)]
            lines.append("")
            if "launches_per_token" in value:
                lines += [f"GPU kernels and copies per generated token, 1 request: {value['launches_per_token']}", ""]
            if "graph_capture_failed" in value:
                lines += [f"Graph capture failed, decoded op by op: {value['graph_capture_failed']}", ""]
        elif key.startswith("http_"):
            lines += _http_lines(key[5:], value)
        elif key.startswith("serve_"):
            lines += serve_lines(key[6:], value)
        elif isinstance(value, dict) and "error" in value:
            lines += [f"{key}: error: {value['error'].splitlines()[0]}", ""]
    return "\n".join(lines).rstrip()


def _ttft_lines(shape: str, value: dict[str, Any], device: str) -> list[str]:
    lines = [f"TTFT, {shape} shape, {value['tokens']} tokens (ms; speed-up vs full):", "",
              "| " + " | ".join(value["policies"]) + " | transformers full | floor: weights | floor: full FLOPs |",
              "|" + "---|" * (len(value["policies"]) + 3),
              "| " + " | ".join(f"{r['ttft_ms']} ({r['speedup_vs_full']}×)" for r in value["policies"].values())
              + f" | {value['transformers_full_ms']} | {value['floor_weights_read_ms']} | "
                f"{value['floor_full_prefill_ms']} |", ""]
    unit = "GPU kernels and copies" if device == "cuda" else "aten ops, views excluded"
    lines += [f"Launches per request ({unit}): " + ", ".join(f"{name} {r['launches']}"
                                                           for name, r in value["policies"].items()
                                                           if "launches" in r), ""]
    capture = value.get("prefill_graph_capture")
    if capture:
        lines += [f"Prefill graphs captured before the +graphs rows (as at load): {capture['graphs']} in "
                  f"{capture['seconds']} s" + (f"; capture failed: {capture['failed']}"
                                               if capture.get("failed") else ""), ""]
        timed = [g for g in capture.get("timed", []) if g["launch_ms"] is not None]
        if timed:
            lines += ["Each graph timed at capture (ms): rows/first layer launch op by op → replay"
                      + " (✗: op by op is faster, runs op by op): "
                      + ", ".join(f"{g['rows']}/{g['first_layer']} {g['launch_ms']}→{g['replay_ms']}"
                                  + ("" if g["replays"] else " ✗") for g in timed), ""]
    if any("host_syncs" in r for r in value["policies"].values()):
        lines += ["Host syncs per request: " + ", ".join(f"{name} {r.get('host_syncs')}"
                                                         for name, r in value["policies"].items()), ""]
    return lines


def _http_lines(shape: str, value: dict[str, Any]) -> list[str]:
    if "skipped" in value or "error" in value:
        return [f"HTTP, {shape} shape: {'skipped' if 'skipped' in value else 'error'}: "
                f"{(value.get('skipped') or value['error']).splitlines()[0]}", ""]
    lines = [f"HTTP, {shape} shape: streamed `/v1/generate`, {value['passages']} stored passages of "
             f"~{value['passage_tokens']} tokens each in a new order, {value['tokens_each']} tokens each, "
             f"policy {value['policy']}:", "",
             "| clients | requests | errors | TTFT p50 s | TTFT p99 s | output tokens/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {c} | {r['requests']} | {r['errors']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} | "
              f"{round(r['output_tokens_per_s'], 1)} |" for c, r in value.items() if isinstance(r, dict)]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    from ragcache_lab.gpu_args import add_gpu_arguments, finish_arguments

    parser = argparse.ArgumentParser(prog="python -m ragcache_lab.gpu", description=__doc__.split("\n\n")[0])
    add_gpu_arguments(parser)
    args = parser.parse_args(argv)
    try:
        finish_arguments(args)
    except ValueError as exc:
        parser.error(str(exc))
    run_gpu_bench(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
