"""`ragcache bench workload`: one RAG request stream replayed against every system.

Every request goes to every system in turn (engine systems, each with its own cache, then the
vLLM systems against one vLLM server, a different `cache_salt` per system so their prefix caches
are separate, fed the same token ids the engine prefills), so machine noise hits all alike. TTFT
for the engine is measured in process; for vLLM by the client up to the first streamed token
(HTTP on loopback included).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import track

from engine_sidecar.calibrate.metrics import rouge_l
from engine_sidecar.engine.engine import Engine, EngineConfig
from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.model.prepare import resolve_model_dir
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.request.prompt import PromptBuilder, segment_digest
from engine_sidecar.request.reorder import ChunkAccessTable
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.vllm_backend.params import connector_config, request_params
from ragcache_integrations.types import Chunk, ChunkedPrompt
from ragcache_lab.report import args_config, publish
from ragcache_lab.stream import (
    Corpus,
    Request,
    build_document_stream,
    build_stream,
    load_corpus,
    overlap_fractions,
)
from ragcache_lab.tables import markdown_table
from ragcache_lab.vllm_peer import VLLM_ENV_HELP, VllmServer, find_vllm_python

ALL_SYSTEMS = ["full", "prefix", "prefix+reorder", "fusion", "fusion+reorder", "fusion+hits-first",
               "fusion+misses-first", "vllm-apc", "vllm-apc+reorder", "vllm+ragcache", "vllm+ragcache-all"]
# vLLM with ragcache's KV connector (engine_sidecar/vllm_backend), the fusion policy in the
# connector, each system its own ragcache tenant. vllm+ragcache (supply="hits"): the client puts the
# chunks it has sent before first, and the connector supplies the leading run of stored chunks.
# vllm+ragcache-all (supply="all"): the client puts the new chunks first and the connector supplies
# every chunk, computing the new ones in place (fusion+misses-first inside vLLM); vLLM computes
# the question and decodes.
CONNECTOR_SYSTEMS = {"vllm+ragcache": "hits", "vllm+ragcache-all": "all"}


@dataclass
class SystemLog:
    ttft: list[float] = field(default_factory=list)
    computed: list[float] = field(default_factory=list)
    hits: int = 0
    lookups: int = 0
    orders: list[list[str]] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    # per request, for looking into a phase's mean: prompt tokens and the engine's stage times
    prompt_tokens: list[int] = field(default_factory=list)
    stage_times: list[dict[str, float]] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        return [{"ttft_s": t, "computed": c, "prompt_tokens": n, "stage_times": st}
                for t, c, n, st in itertools.zip_longest(self.ttft, self.computed, self.prompt_tokens,
                                                         self.stage_times)]


def engine_setup(system: str, ratio: float) -> tuple[str, str, bool]:
    policy = f"cacheblend:{ratio}" if system.startswith("fusion") else system.split("+")[0]
    suffix = system.partition("+")[2]
    order = "frequency" if suffix == "reorder" else suffix or "preserve"
    return policy, order, system != "full"


def prompt_for(corpus_passages: dict[str, str], request: Request, system: str) -> ChunkedPrompt:
    conv = f"{system}/{request.conversation_id}" if request.conversation_id else None
    return ChunkedPrompt(chunks=[Chunk(text=corpus_passages[c], id=c) for c in request.chunk_ids],
                         question=request.question, conversation_id=conv)


def run_workload(args: argparse.Namespace) -> int:
    """Replays one request stream against every system, each request on all of them in turn,
    and publishes their TTFT, computed share and chunk hits side by side."""
    console = Console()
    systems = _systems(args)
    corpus, stream = _corpus_and_stream(args, console)
    model_dir = resolve_model_dir(args.model)
    runner = ModelRunner.load(model_dir, device=args.device, dtype=args.dtype)
    builder = PromptBuilder.load(model_dir)
    logs: dict[str, SystemLog] = {s: SystemLog() for s in systems}
    engine_systems = [s for s in systems if not s.startswith("vllm")]
    engines = _start_engines(engine_systems, args, runner, builder, model_dir)
    vllm_systems = [s for s in systems if s.startswith("vllm")]
    python, vllm_note = _find_vllm(vllm_systems, args.vllm_python, console)
    if vllm_note is not None:
        for s in vllm_systems:
            logs.pop(s)
        vllm_systems = []
    with contextlib.ExitStack() as stack:
        # each engine's scheduler and store threads stopped before the interpreter exits: one still
        # running torch work at exit can abort the process after the results are written
        for engine in engines.values():
            stack.callback(engine.close)
        replay = None
        if vllm_systems and python is not None:
            replay = _start_vllm(stack, args, python, model_dir, builder, corpus.passages, vllm_systems,
                                 console)
        for request in track(stream, description="requests (every system in turn)", console=console):
            for system in engine_systems:
                _replay_on_engine(engines[system], system, request, corpus.passages, args, logs[system])
            if replay is not None:
                replay.step(request, logs)
    summary = workload_summary(logs, args.cold)
    config = args_config(args)
    config.update({"passages": len(corpus.passages), "stream_requests": len(stream),
                   "conversation_turns": sum(1 for r in stream if r.conversation_id),
                   "model": str(model_dir), "vllm_note": vllm_note})
    publish(console, args.json, {"config": config, "systems": summary,
                                 "per_request": {name: log.rows() for name, log in logs.items()}},
            workload_table(summary, config))
    return 0


def _systems(args: argparse.Namespace) -> list[str]:
    """The systems asked for, with the stream's arguments checked (and --cold capped at the
    stream's length) before anything loads."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown:
        raise InvalidPromptError(f"unknown systems {unknown}: choose from {', '.join(ALL_SYSTEMS)}")
    if args.requests < 1 or args.k < 1 or args.cold < 0:
        raise InvalidPromptError("--requests and --k must be at least 1 and --cold at least 0")
    args.cold = min(args.cold, args.requests)
    return systems


def _corpus_and_stream(args: argparse.Namespace, console: Console) -> tuple[Corpus, list[Request]]:
    """The corpus and the request stream every system replays."""
    corpus = load_corpus(args.corpus)
    if not corpus.questions:
        raise InvalidPromptError(f"{args.corpus}: no records with a question")
    console.print(f"corpus: {len(corpus.passages)} passages, {len(corpus.questions)} questions; "
                  f"building a '{args.stream}' stream")
    if args.stream == "documents":
        stream = build_document_stream(corpus, args.requests, args.k, args.documents, args.seed)
    else:
        stream = build_stream(corpus, args.requests, args.k, args.zipf, args.turns, args.conversation_share,
                              args.question_pool, args.seed)
    return corpus, stream


def _start_engines(systems: list[str], args: argparse.Namespace, runner: ModelRunner, builder: PromptBuilder,
                   model_dir: Path) -> dict[str, Engine]:
    """One engine per engine system, each with its own cache over the one shared model, warmed up
    so no system pays first-request costs inside the stream."""
    engines: dict[str, Engine] = {}
    for system in systems:
        _, _, tree = engine_setup(system, args.ratio)
        config = EngineConfig.from_options(model=str(model_dir), disk=False, prefix_tree=tree,
                                           precompute=args.precompute,
                                           ram_cache_bytes=int(args.ram_cache_gb * (1 << 30)))
        engines[system] = Engine(runner, builder, ChunkStore(config.store.ram_bytes, None, runner.device), config,
                                 model_dir)
        engines[system].generate(ChunkedPrompt(question="warm up"), {"max_tokens": 1})
    return engines


def _find_vllm(vllm_systems: list[str], vllm_python: Path | None,
               console: Console) -> tuple[Path | None, str | None]:
    """The vLLM virtualenv's python when vLLM systems were asked for, or the note saying why
    they are skipped."""
    python = find_vllm_python(vllm_python) if vllm_systems else None
    if vllm_systems and python is None:
        note = f"vLLM systems skipped: no vLLM virtualenv found; {VLLM_ENV_HELP}"
        console.print(f"[yellow]{note}[/yellow]")
        return None, note
    return python, None


def _start_vllm(stack: contextlib.ExitStack, args: argparse.Namespace, python: Path, model_dir: Path,
                builder: PromptBuilder, passages: dict[str, str], vllm_systems: list[str],
                console: Console) -> VllmReplay:
    """One vLLM server for every vLLM system (stopped with `stack`), warmed up; with ragcache's
    KV connector when a connector system is measured."""
    log_path = Path(args.json or "workload.json").with_suffix(".vllm.log")
    console.print(f"starting vLLM from {python} (log: {log_path})")
    # Every request goes to every system in turn, so machine noise hits all alike. vLLM's
    # engine loop spins while idle (over one core here), which would slow the engine
    # systems beside it: it sleeps when idle and its OpenMP threads wait passively, as
    # the engine's do (measured on these 2 cores: no slower for vLLM itself).
    stats_path = None
    connector = None
    if any(system in CONNECTOR_SYSTEMS for system in vllm_systems):
        stats_path = log_path.with_suffix(".ragcache-stats.jsonl")
        stats_path.unlink(missing_ok=True)
        connector = connector_config(args.ram_cache_gb, str(stats_path.resolve()))
    server = stack.enter_context(VllmServer(
        python, model_dir, args.dtype if args.dtype != "auto" else "float32", 8192, log_path,
        env={"VLLM_SLEEP_WHEN_IDLE": "1", "OMP_WAIT_POLICY": "PASSIVE"}, kv_transfer_config=connector))
    server.complete(builder.encode("warm up"), 1, "warmup")
    return VllmReplay(server, builder, passages, vllm_systems, args.max_tokens, f"cacheblend:{args.ratio}",
                      stats_path)


def _replay_on_engine(engine: Engine, system: str, request: Request, passages: dict[str, str],
                      args: argparse.Namespace, log: SystemLog) -> None:
    """One request on one engine system, logged: TTFT, computed share, chunk hits, the chunk
    order it prefilled, the answer, prompt tokens and stage times."""
    policy, order, _ = engine_setup(system, args.ratio)
    result = engine.generate(prompt_for(passages, request, system), {"max_tokens": args.max_tokens},
                             policy=policy, order=order)
    s = result.stats
    log.ttft.append(s.ttft_s)
    log.computed.append(s.computed_fraction)
    log.hits += s.chunk_hits
    log.lookups += sum(1 for span in s.plan if span["kind"] == "chunk")
    log.orders.append([span["chunk_id"] for span in s.plan if span["kind"] == "chunk"])
    log.answers.append(result.text)
    log.prompt_tokens.append(s.prefill_tokens_total)
    log.stage_times.append(dict(s.stage_times))


class VllmReplay:
    """The vLLM systems' side of the stream: the same prompts (reordered by their own CA-Tables
    for +reorder), conversations continued from their own history, each system with its own
    `cache_salt` so their prefix caches stay apart."""

    def __init__(self, server: VllmServer, builder: PromptBuilder, passages: dict[str, str], systems: list[str],
                 max_tokens: int, connector_policy: str = "cacheblend", stats_path: Path | None = None):
        self.server, self.builder, self.passages, self.systems = server, builder, passages, systems
        self.max_tokens = max_tokens
        self.connector_policy, self.stats_path = connector_policy, stats_path
        self.stats_read = 0  # lines of the connector's stats file consumed
        # chunk ids each connector system has sent (its hits-first or misses-first order)
        self.sent: dict[str, set[str]] = {system: set() for system in CONNECTOR_SYSTEMS}
        self.eos = {builder.tokenizer.eos_token_id, builder.tokenizer.convert_tokens_to_ids("<|im_end|>")}
        self.tables = {s: ChunkAccessTable() for s in systems}
        self.conversations: dict[tuple[str, str], tuple[list[int], set[str]]] = {}

    def step(self, request: Request, logs: dict[str, SystemLog]) -> None:
        builder = self.builder
        for system in self.systems:
            prompt = prompt_for(self.passages, request, system)
            self.tables[system].record([c.id or "" for c in prompt.chunks])
            if system.endswith("+reorder"):
                prompt = prompt.model_copy(update={"chunks": self.tables[system].sort(prompt.chunks, lambda c: c.id)})
            elif system in CONNECTOR_SYSTEMS:
                sent = self.sent[system]
                old = [c for c in prompt.chunks if c.id in sent]
                new = [c for c in prompt.chunks if c.id not in sent]
                sent.update(c.id or "" for c in prompt.chunks)
                chunks = new + old if CONNECTOR_SYSTEMS[system] == "all" else old + new
                prompt = prompt.model_copy(update={"chunks": chunks})
            key = (system, prompt.conversation_id or "")
            history = self.conversations.get(key) if prompt.conversation_id else None
            if history is None:
                assembled = builder.build(prompt)
                ids, known = assembled.token_ids, set()
            else:
                known = history[1]
                assembled = builder.build_followup(prompt, known)
                ids = history[0] + assembled.token_ids
            chunk_segs = [s for s in assembled.segments if s.kind == "chunk"]
            # the connector supplies KV for ragcache's own layout; a follow-up turn (history + new
            # turn) is not one, and goes to vLLM as a plain request (its prefix cache holds the history)
            params = (request_params(prompt, self.connector_policy, system.replace("+", "-"), CONNECTOR_SYSTEMS[system])
                      if system in CONNECTOR_SYSTEMS and history is None else None)
            response = self.server.complete(ids, self.max_tokens, system, params)
            answer = [t for t in response.token_ids if t not in self.eos]
            if prompt.conversation_id:
                self.conversations[key] = (ids + answer, known | {segment_digest(s) for s in chunk_segs})
            log = logs[system]
            log.ttft.append(response.ttft_s)
            stats = self._connector_stats() if params is not None else None
            prompt_tokens = max(1, response.prompt_tokens)
            computed = 1.0 - response.cached_tokens / prompt_tokens
            if stats is not None:  # ragcache's work for the tokens it supplied counts too
                computed += stats["ragcache_token_layers"] / (stats["layers"] * prompt_tokens)
            log.computed.append(computed)
            end = len(ids) - len(assembled.token_ids)
            for seg in assembled.segments:
                end += len(seg.token_ids)
                if seg.kind == "chunk":
                    log.lookups += 1
                    if stats is None:
                        log.hits += int(end <= response.cached_tokens)
            if stats is not None:
                log.hits += stats["chunk_hits"]
            log.orders.append([s.chunk_id or "" for s in chunk_segs])
            log.answers.append(builder.decode(answer))
            log.prompt_tokens.append(response.prompt_tokens)


    def _connector_stats(self) -> dict[str, Any] | None:
        """The connector's stats line for the request just served (written before its first
        token: ragcache learns the prompt in the step that completes it)."""
        if self.stats_path is None or not self.stats_path.exists():
            return None
        lines = self.stats_path.read_text(encoding="utf-8").splitlines()
        new, self.stats_read = lines[self.stats_read :], len(lines)
        return json.loads(new[-1]) if new else None


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


PHASES = ("all", "cold", "warm")


def _phase(values: list, phase: str, cold: int) -> list:
    return values if phase == "all" else values[:cold] if phase == "cold" else values[cold:]


def workload_summary(logs: dict[str, SystemLog], cold: int = 0) -> dict[str, dict[str, Any]]:
    """Per system: TTFT and computed share over the whole stream, its cold phase (the first
    `cold` requests) and its warm phase (the rest); hit ratio, overlap, ROUGE-L vs full."""
    out: dict[str, dict[str, Any]] = {}
    reference = logs.get("full")
    for name, log in logs.items():
        aligned, total = overlap_fractions(log.orders)
        m: dict[str, Any] = {
            "chunk_hit_ratio": log.hits / max(1, log.lookups), "prefix_aligned_fraction": aligned,
            "total_overlap_fraction": total, "requests": len(log.ttft),
        }
        for phase in PHASES:
            ttft, computed = _phase(log.ttft, phase, cold), _phase(log.computed, phase, cold)
            tag = "" if phase == "all" else f"{phase}_"
            if not ttft:
                continue
            m[f"{tag}ttft_mean_s"] = statistics.mean(ttft)
            m[f"{tag}ttft_p50_s"] = _p(ttft, 0.5)
            m[f"{tag}ttft_p99_s"] = _p(ttft, 0.99)
            m[f"{tag}computed_fraction"] = statistics.mean(computed)
        if reference is not None and reference.answers:
            m["rouge_l_vs_full"] = statistics.mean(
                rouge_l(a, b) for a, b in zip(log.answers, reference.answers, strict=True))
        out[name] = m
    for peer in ("vllm-apc", "vllm-apc+reorder"):
        if peer in out:
            for m in out.values():
                for tag in ("", "cold_", "warm_"):
                    if f"{tag}ttft_mean_s" in m and f"{tag}ttft_mean_s" in out[peer]:
                        m[f"{tag}ttft_mean_ratio_vs_{peer}"] = m[f"{tag}ttft_mean_s"] / out[peer][f"{tag}ttft_mean_s"]
    return out


def workload_table(summary: dict[str, dict[str, Any]], config: dict[str, Any]) -> str:
    peers = [p for p in ("vllm-apc", "vllm-apc+reorder") if p in summary]
    shape = (f"'{config.get('stream', 'questions')}' stream: {config['stream_requests']} requests "
             f"({config['conversation_turns']} in conversations), cold phase = first {config.get('cold', 0)}, "
             f"k={config['k']}, dtype={config['dtype']}, fusion recompute ratio {config.get('ratio')}, "
             f"misses {config.get('precompute', 'in-place')}")
    timing = []
    for name, m in summary.items():
        for phase in PHASES:
            tag = "" if phase == "all" else f"{phase}_"
            if f"{tag}ttft_mean_s" not in m:
                continue
            timing.append([name, phase, *(f"{m[f'{tag}{key}']:.3f}" for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
                                                                                  "computed_fraction")),
                           *(f"{m[ratio]:.2f}x" if (ratio := f"{tag}ttft_mean_ratio_vs_{p}") in m else "" for p in peers)])
    reuse = [[name, f"{m['chunk_hit_ratio']:.2f}", f"{m['prefix_aligned_fraction']:.2f}",
              f"{m['total_overlap_fraction']:.2f}", f"{m.get('rouge_l_vs_full', float('nan')):.3f}"]
             for name, m in summary.items()]
    lines = [shape, "",
             markdown_table(["system", "phase", "TTFT mean (s)", "p50", "p99", "computed (all work)",
                             *(f"vs {p}" for p in peers)], timing), "",
             markdown_table(["system", "chunk hits", "prefix-aligned", "total overlap", "ROUGE-L vs full"], reuse)]
    if config.get("vllm_note"):
        lines += ["", config["vllm_note"]]
    return "\n".join(lines)
