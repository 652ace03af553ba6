"""Every Triton kernel compiled for a GPU that is not here, at the shapes the engine launches.

`python -m ragcache_kernels.cross_compile` (`make cross-compile`) runs the kernels' own launchers
on empty CPU tensors of production shapes (the default model's heads and Llama-3.2-1B's and
Llama-3-8B's; a 6,231-token prompt, the rows a fused prefill recomputes, a `reuse` request's few
question rows, decode batches of 1, 8 and 32) while Triton's active driver names the target GPU
and each launch is turned into a compile, so nothing runs. Each compiled variant is checked
against the target's limits (shared memory per block, registers per thread, threads per block)
and ptxas's own report of its registers and spills is read. Last, a stream of requests of
varying lengths is compiled the same way, to count the variants (the compiles a server meets). A kernel that would not compile or
load on the card, or that spills kilobytes of registers, fails here, on a CPU machine, before any
device time is spent.

Run it in a process where TRITON_INTERPRET is unset: under the interpreter `triton.jit` makes no
compilable kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch


@dataclass(frozen=True)
class Target:
    name: str
    capability: int  # 90 = sm_90(a), Hopper
    multiprocessors: int  # sizes the launchers' key splits as on the card
    shared_bytes: int  # per block, opted in
    registers_per_thread: int = 255
    threads_per_block: int = 1024
    registers_per_multiprocessor: int = 65536
    warp_size: int = 32


TARGETS = {
    "h100": Target("NVIDIA H100 (sm_90a)", 90, 132, 227 * 1024),
    "h200": Target("NVIDIA H200 (sm_90a)", 90, 132, 227 * 1024),
    "a100": Target("NVIDIA A100 (sm_80)", 80, 108, 163 * 1024),
}

# (query heads, KV heads, head dim): the default model (SmolLM2-135M), Llama-3.2-1B, Llama-3-8B
HEAD_SHAPES = {"smollm2": (9, 3, 64), "1b": (32, 8, 64), "8b": (32, 8, 128)}
PROMPT_TOKENS = 6231  # ten ~600-token passages and a question, as `bench gpu` asks
FUSED_ROWS = 1100  # what `cacheblend:0.15` recomputes of that prompt
QUESTION_ROWS = 38  # a `reuse` request's rows
SEGMENTS = 11  # Cache-Craft's attention mass: ten passages and the question
DECODE_BATCHES = (1, 8, 32)
SLIDING_WINDOW = 4096
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# A few spilled bytes per thread are noise between Triton versions; kilobytes are local-memory
# traffic on every tile (fp32 attention tiles of 64 x 64 once spilled ~40 KB per thread).
SPILL_LIMIT_BYTES = 1024


@dataclass
class Compiled:
    kernel: str
    launches: list[str]  # which of the engine's launches reached this compiled variant
    constants: dict[str, Any]
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int | None = None
    spill_bytes: int | None = None
    problems: list[str] | None = None


class _CrossDriver:
    """Triton's driver interface, as far as compiling needs it, naming a GPU that is not here."""

    def __init__(self, target: Target) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", target.capability, target.warp_size)

    def get_current_target(self):  # noqa: ANN201 - Triton's own type
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compiling_for(target: Target, record: Callable[[Any, Any], None]) -> Iterator[None]:
    """Inside, a kernel launch compiles for `target` and calls record(jit function, compiled
    kernel) instead of running; the launchers accept CPU tensors and see the target's
    multiprocessor count."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from ragcache_kernels import (
        triton_attention,
        triton_decode,
        triton_kv,
        triton_mlp,
        triton_prefill_table,
        triton_rope,
    )

    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        record(self, kernel)
        return kernel

    with contextlib.ExitStack() as stack:
        for module in (triton_attention, triton_decode, triton_kv, triton_mlp, triton_prefill_table, triton_rope):
            stack.enter_context(mock.patch.object(module, "check_device", lambda *tensors: None))
        for module in (triton_attention, triton_decode):
            stack.enter_context(mock.patch.object(module, "multiprocessors", lambda device: target.multiprocessors))
        stack.enter_context(mock.patch.object(JITFunction, "run", compile_only))
        # put back what was active, not Triton's default: making the default needs a GPU
        stack.callback(setattr, driver, "_active", getattr(driver, "_active", None))
        driver.set_active(_CrossDriver(target))
        yield


# --- the engine's launches -------------------------------------------------------------------------
def engine_launches(heads: tuple[int, int, int], dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """Label -> a call of a kernel launcher as the engine makes it, on empty tensors."""
    from ragcache_kernels import (
        triton_attention,
        triton_decode,
        triton_kv,
        triton_mlp,
        triton_prefill_table,
        triton_rope,
    )

    h, hkv, d = heads
    n = PROMPT_TOKENS

    def empty(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*size, dtype=dt)

    keys, values = empty(n, hkv, d), empty(n, hkv, d)
    positions = torch.arange(n)

    def attend(rows: int, **options: Any) -> Callable[[], Any]:
        index = torch.linspace(0, n - 1, rows).long()
        # keys at their index (key_pos None), as the fused prefill passes them
        return lambda: triton_attention.selective_attention(empty(rows, h, d), keys, values, index, None,
                                                             **options)

    def decode(batch: int) -> Callable[[], Any]:
        def run() -> None:
            buffers = [empty(1, n + 64, hkv, d) for _ in range(3 * batch)]
            step = triton_decode.decode_batch_table(buffers[:batch], buffers[batch : 2 * batch],
                                                    buffers[2 * batch :], [n] * batch)
            new = empty(batch, hkv, d)
            step.write_and_attend(0, empty(batch, h, d), new, new, new)

        return run

    def sparse_layer(bucket: int, splits: int) -> Callable[[], Any]:
        def run() -> None:
            inputs = torch.zeros(triton_prefill_table.TABLE_SIZE + bucket, dtype=torch.int64)
            view = triton_prefill_table.PrefillTable(inputs[: triton_prefill_table.TABLE_SIZE],
                                                     inputs[triton_prefill_table.TABLE_SIZE :], h, hkv, d, splits)
            view.attend(1, view.store(1, empty(bucket, (h + 2 * hkv) * d), torch.ones(d // 2)))

        return run

    calls: dict[str, Callable[[], Any]] = {
        "full prefill": attend(n),
        "fused prefill (cacheblend:0.15 rows)": attend(FUSED_ROWS),
        "reuse (question rows, keys split)": attend(QUESTION_ROWS),
        "attention mass (cachecraft)": attend(FUSED_ROWS, segment_ids=torch.arange(n) % SEGMENTS,
                                              num_segments=SEGMENTS),
        "sliding window": attend(FUSED_ROWS, sliding_window=SLIDING_WINDOW),
        "kv deviation (check layer)": lambda: triton_kv.kv_deviation(empty(n, hkv, d), keys),
        "kv deviation of chosen rows": lambda: triton_kv.kv_deviation(
            empty(FUSED_ROWS, hkv, d), keys, torch.arange(FUSED_ROWS), torch.zeros(FUSED_ROWS)),
        "scatter rows": lambda: triton_kv.scatter_rows(empty(n, hkv, d), torch.arange(FUSED_ROWS),
                                                       empty(FUSED_ROWS, hkv, d)),
        "rotate keys": lambda: triton_rope.rotate_keys(keys, positions, torch.ones(d // 2), out=empty(n, hkv, d)),
        "rotate every layer's keys": lambda: triton_rope.rotate_keys(empty(4, n, hkv, d), positions, torch.ones(d // 2),
                                                                    out=empty(4, n, hkv, d)),
        "swiglu activation": lambda: triton_mlp.silu_mul(empty(64, 2 * 4 * h * d)),
        "rope and store a layer's rows": lambda: triton_rope.rope_and_store(
            empty(64, (h + 2 * hkv) * d), h, hkv, torch.arange(64), torch.ones(d // 2), empty(n, hkv, d),
            empty(n, hkv, d), empty(n, hkv, d)),
    }
    for batch in DECODE_BATCHES:
        calls[f"decode, batch {batch}"] = decode(batch)
    calls["graphed sparse layer (question rows, keys split)"] = sparse_layer(QUESTION_ROWS, 4)
    calls["graphed sparse layer (cacheblend:0.15 rows)"] = sparse_layer(FUSED_ROWS, 1)
    return calls


def run_request_stream(heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The launches of a stream of requests whose lengths vary (prompts of 100 to 1,024 tokens,
    1 to all rows recomputed, decode batches of 1 to 16 at several lengths and layers): a kernel
    compiles once per variant, so the variants it makes are the compiles a server meets."""
    from ragcache_kernels import (
        triton_attention,
        triton_decode,
        triton_kv,
        triton_mlp,
        triton_prefill_table,
        triton_rope,
    )

    h, hkv, d = heads

    def empty(*size: int) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype)

    for n in (100, 128, 257, 1000, 1024):
        keys = empty(n, hkv, d)
        for rows in (1, 7, 16, 33, 64, n):
            index = torch.linspace(0, n - 1, rows).long()
            triton_attention.selective_attention(empty(rows, h, d), keys, keys, index, None)
            triton_kv.scatter_rows(empty(n, hkv, d), index, empty(rows, hkv, d))
            triton_kv.kv_deviation(empty(rows, hkv, d), keys, index)
            triton_rope.rope_and_store(empty(rows, (h + 2 * hkv) * d), h, hkv, index, torch.ones(d // 2), keys,
                                       empty(n, hkv, d), empty(n, hkv, d))
            triton_mlp.silu_mul(empty(rows, 2 * 4 * h * d))
        triton_rope.rotate_keys(keys, torch.arange(n), torch.ones(d // 2), out=empty(n, hkv, d))
    for bucket in (16, 64, 256, 1024):  # the prefill graphs' buckets, split or not
        for splits in (1, 4):
            inputs = torch.zeros(triton_prefill_table.TABLE_SIZE + bucket, dtype=torch.int64)
            view = triton_prefill_table.PrefillTable(inputs[: triton_prefill_table.TABLE_SIZE],
                                                     inputs[triton_prefill_table.TABLE_SIZE :], h, hkv, d, splits)
            for layer in (0, 1):
                view.attend(layer, view.store(layer, empty(bucket, (h + 2 * hkv) * d), torch.ones(d // 2)))
    for batch in (1, 2, 3, 8, 16):
        buffers = [empty(2, 1100, hkv, d) for _ in range(3 * batch)]
        for position in (100, 1000, 1024):
            step = triton_decode.decode_batch_table(buffers[:batch], buffers[batch : 2 * batch],
                                                    buffers[2 * batch :], [position] * batch)
            for layer in (0, 1):
                new = empty(batch, hkv, d)
                step.write_and_attend(layer, empty(batch, h, d), new, new, new)


def stream_variants(target: Target, heads: tuple[int, int, int], dtype: torch.dtype) -> dict[str, int]:
    """Kernel -> how many variants `run_request_stream` compiles."""
    seen: dict[str, set[int]] = {}
    with compiling_for(target, lambda function, kernel: seen.setdefault(function.fn.__name__.lstrip("_"),
                                                                       set()).add(id(kernel))):
        run_request_stream(heads, dtype)
    return {name: len(kernels) for name, kernels in sorted(seen.items())}


# --- checks ------------------------------------------------------------------------------------------
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(ptx: str, capability: int) -> tuple[int | None, int | None]:
    """(registers per thread, spilled bytes) as ptxas reports them for this PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if capability >= 90 else ""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name=sm_{capability}{suffix}",
                               str(source), "-o", str(Path(folder) / "kernel.cubin")],
                              capture_output=True, text=True, check=False)
    log = done.stdout + done.stderr
    registers = _REGISTERS.search(log)
    spills = _SPILLS.search(log)
    return (int(registers.group(1)) if registers else None,
            int(spills.group(1)) + int(spills.group(2)) if spills else None)


def limits_problems(entry: Compiled, target: Target) -> list[str]:
    problems = []
    if entry.shared_bytes > target.shared_bytes:
        problems.append(f"shared memory {entry.shared_bytes} B > {target.shared_bytes} B per block")
    threads = entry.num_warps * target.warp_size
    if threads > target.threads_per_block:
        problems.append(f"{threads} threads > {target.threads_per_block} per block")
    if entry.spill_bytes is not None and entry.spill_bytes > SPILL_LIMIT_BYTES:
        problems.append(f"{entry.spill_bytes} B of registers spilled per thread (> {SPILL_LIMIT_BYTES})")
    if entry.registers is not None:
        if entry.registers > target.registers_per_thread:
            problems.append(f"{entry.registers} registers > {target.registers_per_thread} per thread")
        if entry.registers * threads > target.registers_per_multiprocessor:
            problems.append(f"{entry.registers} registers x {threads} threads exceed a multiprocessor's file")
    return problems


def cross_compile(target: Target, shapes: list[str], dtypes: list[str]) -> tuple[list[Compiled], list[str]]:
    """Compile every launch for `target`: the compiled variants, and the launches that failed."""
    variants: dict[int, Compiled] = {}
    failures: list[str] = []
    label = ""

    def record(function: Any, kernel: Any) -> None:
        entry = variants.get(id(kernel))
        if entry is None:
            meta = kernel.metadata
            constants = {k if isinstance(k, str) else function.arg_names[k[0]]: v
                         for k, v in getattr(kernel.src, "constants", {}).items()}
            entry = variants[id(kernel)] = Compiled(function.fn.__name__.lstrip("_"), [], constants, meta.num_warps,
                                                    meta.num_stages, meta.shared)
            entry.registers, entry.spill_bytes = ptxas_report(kernel.asm["ptx"], target.capability)
            entry.problems = limits_problems(entry, target)
        if label not in entry.launches:
            entry.launches.append(label)

    with compiling_for(target, record):
        for shape in shapes:
            for dtype_name in dtypes:
                calls = engine_launches(HEAD_SHAPES[shape], DTYPES[dtype_name])
                if dtype_name != "float32":
                    calls.update(tile_launches(HEAD_SHAPES[shape], DTYPES[dtype_name]))
                for name, call in calls.items():
                    label = f"{shape} {dtype_name}: {name}"
                    try:
                        call()
                    except Exception as error:  # a compile error is the finding: report it, go on
                        failures.append(f"{label}: {type(error).__name__}: {str(error).strip()[:500]}")
    return list(variants.values()), failures


def tile_launches(heads: tuple[int, int, int], dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """The fused prefill's attention at each tile `ragcache bench gpu` may time on the card."""
    from ragcache_kernels import triton_attention

    h, hkv, d = heads
    n, rows = PROMPT_TOKENS, FUSED_ROWS
    keys = torch.empty(n, hkv, d, dtype=dtype)
    index = torch.linspace(0, n - 1, rows).long()
    return {f"tile {m}x{k}, {warps} warps, {stages} stages": functools.partial(
        triton_attention.selective_attention, torch.empty(rows, h, d, dtype=dtype), keys, keys, index,
        torch.arange(n), block_m=m, block_n=k, splits=1, num_warps=warps, num_stages=stages)
        for m, k, warps, stages in triton_attention.TILE_CANDIDATES}


# --- the command -------------------------------------------------------------------------------------
def markdown(target: Target, variants: list[Compiled], failures: list[str]) -> str:
    lines = [f"Triton kernels compiled for {target.name}: {len(variants)} variants, {len(failures)} failed launches",
             "", "| kernel | launches | warps | stages | shared B | registers | spilled B | problems |",
             "|---|---|---|---|---|---|---|---|"]
    for v in sorted(variants, key=lambda v: (v.kernel, -(v.registers or 0))):
        shown = "; ".join(v.launches[:3]) + (f"; +{len(v.launches) - 3} more" if len(v.launches) > 3 else "")
        lines.append(f"| {v.kernel} | {shown} | {v.num_warps} | {v.num_stages} | {v.shared_bytes} | "
                     f"{v.registers} | {v.spill_bytes} | {'; '.join(v.problems or []) or 'none'} |")
    lines += [f"- failed: {f}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ragcache_kernels.cross_compile",
        description="Compile every Triton kernel of ragcache for a GPU that is not here, at the shapes the "
                    "engine launches, and check each against the card's limits (shared memory, registers, "
                    "spills). Needs Triton (its bundled ptxas); no GPU, nothing runs. Exits 1 if a launch "
                    "fails to compile or a variant exceeds a limit.")
    p.add_argument("--target", choices=sorted(TARGETS), default="h100", help="the card (default h100)")
    p.add_argument("--shapes", default=",".join(HEAD_SHAPES),
                   help=f"head shapes, comma-separated from {', '.join(HEAD_SHAPES)} (default all)")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help=f"from {', '.join(DTYPES)}, comma-separated (default all)")
    p.add_argument("--json", type=Path, help="also write the variants and failures here")
    args = p.parse_args(argv)
    shapes, dtypes = args.shapes.split(","), args.dtypes.split(",")
    unknown = [s for s in shapes if s not in HEAD_SHAPES] + [d for d in dtypes if d not in DTYPES]
    if unknown:
        p.error(f"unknown shape or dtype: {', '.join(unknown)}")
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 is set: the interpreter makes no compilable kernels; unset it")
    target = TARGETS[args.target]
    variants, failures = cross_compile(target, shapes, dtypes)
    stream = stream_variants(target, HEAD_SHAPES[shapes[0]], DTYPES[dtypes[0]])
    print(markdown(target, variants, failures))
    print(f"\nVariants a stream of requests of varying lengths compiles ({shapes[0]}, {dtypes[0]}): "
          + ", ".join(f"{name} {count}" for name, count in stream.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": asdict(target), "variants": [asdict(v) for v in variants],
                                         "failures": failures, "stream_variants": stream}, indent=2, default=str))
    return 1 if failures or any(v.problems for v in variants) else 0


if __name__ == "__main__":
    sys.exit(main())
