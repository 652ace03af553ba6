"""`ragcache bench gpu`'s flags (argparse only: building the CLI's parser imports no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ragcache_integrations.policy_registry import DEFAULT_POLICY, PolicySpecError, parse_policy_spec

SHAPE_NAMES = ("tiny", "small", "1b", "8b", "qwen3-8b", "qwen3-30b-a3b", "gemma3-12b")  # ragcache_lab.gpu.SHAPES
SECTION_NAMES = ("kernels", "guards", "ttft", "decode", "http", "serve", "tiles")


def add_gpu_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--shapes", default=None, help=f"comma list of model shapes from {', '.join(SHAPE_NAMES)} "
                                                  "(default 1b,8b; tiny with --quick)")
    p.add_argument("--quick", action="store_true", help="a dry run: tiny shapes, few repetitions, short decodes")
    p.add_argument("--passages", type=int, default=None, help="stored passages per prompt (default 10; 3 with --quick)")
    p.add_argument("--passage-tokens", type=int, default=None, help="tokens per passage (default 600; 60 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per cell, median reported "
                                                            "(default 7; 2 with --quick)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens per request in the decode section "
                                                                  "(default 128; 4 with --quick)")
    p.add_argument("--concurrency", default=None, help="comma list of concurrent requests for decode "
                                                       "(default 1,8,32; 1,2 with --quick)")
    p.add_argument("--http-clients", default=None, help="comma list of concurrent streamed HTTP clients "
                                                        "(default 1,8; 1,2 with --quick; 0 skips the section)")
    p.add_argument("--http-requests", type=int, default=None, help="requests each HTTP client sends per level "
                                                                  "(default 4; 1 with --quick)")
    p.add_argument("--http-passages", type=int, default=None, help="stored passages per HTTP request "
                                                                  "(default 8; 2 with --quick)")
    p.add_argument("--http-passage-tokens", type=int, default=None, help="tokens per passage of an HTTP request "
                                                                        "(default 200; 60 with --quick)")
    p.add_argument("--http-policy", default=DEFAULT_POLICY, help=f"policy of the HTTP requests (default {DEFAULT_POLICY})")
    p.add_argument("--serve-corpus", type=int, default=None, help="passages of the serve section's shared corpus, "
                                                                  "warmed before its requests (default 64; 8 with "
                                                                  "--quick; each ~--http-passage-tokens long)")
    p.add_argument("--serve-passages", type=int, default=None, help="passages per serve request, drawn Zipf-like "
                                                                   "(s=1) from the corpus (default 10; 3 with --quick)")
    p.add_argument("--serve-tokens", default=None, help="LO-HI: each serve request's output length, drawn uniformly, "
                                                        "decoded past EOS (default 128-256; 4-6 with --quick)")
    p.add_argument("--serve-clients", default=None, help="comma list of closed-loop client counts of the serve "
                                                         "section, sending clients x --http-requests requests "
                                                         "(default 8,32,64,128; 1,2 with --quick)")
    p.add_argument("--serve-rates", default=None, help="comma list of open-loop Poisson arrival rates of the serve "
                                                       "section, requests/s, each sending max(8, 30 s x rate) "
                                                       "requests (default 1,4; 4 with --quick, then max(8, 2 s x "
                                                       "rate))")
    p.add_argument("--serve-policies", default=None, help="comma list of the policies the serve section runs side by "
                                                          f"side (default {DEFAULT_POLICY},full)")
    p.add_argument("--serve-kv-block-size", type=int, default=0, help="rows per block of the serve section's KV "
                                                                     "block pool (the engine's --kv-block-size; "
                                                                     "default 0: a buffer per request)")
    p.add_argument("--ram-gib", type=float, default=20.0, help="RAM (or device) budget of the chunk store, GiB")
    p.add_argument("--tokenizer", type=Path, default=None, help="folder with the tokenizer files "
                                                                "(default: the prepared default model's)")
    p.add_argument("--data", type=Path, default=None, help="QA set whose passages fill the prompts "
                                                           "(default ../shared/data/musique_s.json, else the bundled sample)")
    p.add_argument("--sections", default=",".join(SECTION_NAMES),
                   help=f"comma list of sections to run, from {', '.join(SECTION_NAMES)} (default all; the "
                        "peaks are always measured)")
    p.add_argument("--profile", default="", help="comma list of policies to profile once per shape (torch.profiler "
                                                 "tables in profile-SHAPE.txt beside the JSON); default none")
    p.add_argument("--out", type=Path, default=Path("bench-results/gpu"), help="folder for bench-gpu.json and .md")


def finish_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick and check the ranges (one line each, before any work)."""
    quick = args.quick
    args.passages = args.passages or (3 if quick else 10)
    args.passage_tokens = args.passage_tokens or (60 if quick else 600)
    args.repeats = args.repeats or (2 if quick else 7)
    args.decode_tokens = args.decode_tokens or (4 if quick else 128)
    args.shapes = [s.strip() for s in (args.shapes or ("tiny" if quick else "1b,8b")).split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPE_NAMES]
    if unknown or not args.shapes:
        raise ValueError(f"--shapes: unknown {', '.join(unknown) or '(none given)'}; use {', '.join(SHAPE_NAMES)}")
    args.sections = [s.strip() for s in str(args.sections).split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTION_NAMES]
    if unknown or not args.sections:
        raise ValueError(f"--sections: unknown {', '.join(unknown) or '(none given)'}; use {', '.join(SECTION_NAMES)}")
    args.concurrency = _whole_numbers("--concurrency", args.concurrency or ("1,2" if quick else "1,8,32"))
    clients = _whole_numbers("--http-clients", args.http_clients or ("1,2" if quick else "1,8"))
    args.http_clients = [] if clients == [0] else clients
    args.http_requests = args.http_requests or (1 if quick else 4)
    args.http_passages = args.http_passages or (2 if quick else 8)
    args.http_passage_tokens = args.http_passage_tokens or (60 if quick else 200)
    _finish_serve(args)
    for name in ("passages", "passage_tokens", "repeats", "decode_tokens", "http_requests", "http_passages",
                 "http_passage_tokens", "serve_corpus", "serve_passages"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least 1")
    if not args.concurrency or min(args.concurrency) < 1:
        raise ValueError("--concurrency: whole numbers >= 1")
    if args.http_clients and min(args.http_clients) < 1:
        raise ValueError("--http-clients: whole numbers >= 1, or 0 alone to skip the section")
    try:  # a bad spec would otherwise surface only as the HTTP section's failed requests
        parse_policy_spec(args.http_policy)
    except PolicySpecError as exc:
        raise ValueError(f"--http-policy: {exc}") from None
    if args.serve_passages > args.serve_corpus:
        raise ValueError(f"--serve-passages: at most --serve-corpus ({args.serve_corpus}): a request's passages "
                         "are distinct")
    if args.ram_gib <= 0:
        raise ValueError("--ram-gib: must be above 0")
    args.ram_bytes = int(args.ram_gib * 2**30)
    return args


def _finish_serve(args: argparse.Namespace) -> None:
    quick = args.quick
    args.serve_corpus = args.serve_corpus or (8 if quick else 64)
    args.serve_passages = args.serve_passages or (3 if quick else 10)
    args.serve_tokens = _token_range(args.serve_tokens or ("4-6" if quick else "128-256"))
    args.serve_clients = _whole_numbers("--serve-clients", args.serve_clients or ("1,2" if quick else "8,32,64,128"))
    if not args.serve_clients or min(args.serve_clients) < 1:
        raise ValueError("--serve-clients: whole numbers >= 1")
    text = args.serve_rates or ("4" if quick else "1,4")
    try:
        args.serve_rates = [float(c) for c in str(text).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--serve-rates: a comma list of requests per second, got '{text}'") from None
    if not args.serve_rates or not all(0 < rate < float("inf") for rate in args.serve_rates):  # nan fails too
        raise ValueError(f"--serve-rates: requests per second above 0, got '{text}'")
    args.serve_policies = [s.strip() for s in (args.serve_policies or f"{DEFAULT_POLICY},full").split(",") if s.strip()]
    if not args.serve_policies:
        raise ValueError("--serve-policies: name at least one policy")
    for spec in args.serve_policies:
        try:
            parse_policy_spec(spec)
        except PolicySpecError as exc:
            raise ValueError(f"--serve-policies: {exc}") from None


def _token_range(text: str) -> tuple[int, int]:
    lo, _, hi = str(text).partition("-")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise ValueError(f"--serve-tokens: LO-HI with 1 <= LO <= HI, got '{text}'")
    return low, high


def _whole_numbers(flag: str, text: str) -> list[int]:
    try:
        return [int(c) for c in str(text).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"{flag}: a comma list of whole numbers, got '{text}'") from None
