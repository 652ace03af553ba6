"""`ragcache bench fidelity` over one or several chunk-KV modes: one run per mode, and several
paired question by question into one table (each policy as `policy@mode`), so one command shows
e.g. the default on KV warmed after neighbours against CacheBlend on KV computed alone."""

from __future__ import annotations

import argparse
from typing import Any

from engine_sidecar.bench.fidelity import run_one
from engine_sidecar.bench.paired_runs import pair_loaded
from engine_sidecar.bench.policy_specs import BASELINE
from engine_sidecar.errors import InvalidPromptError


def run_fidelity(args: argparse.Namespace) -> int:
    """One run per `--chunk-kv` mode; several are paired into one table."""
    modes = [args.chunk_kv] if isinstance(args.chunk_kv, str) else list(args.chunk_kv)
    if len(modes) == 1:
        args.chunk_kv = modes[0]
        if "@" in getattr(args, "baseline", BASELINE):
            args.baseline = paired_baseline(args.baseline, args.policies, modes).rsplit("@", 1)[0]
        run_one(args)
        return 0
    baseline = paired_baseline(getattr(args, "baseline", BASELINE), args.policies, modes)
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    for mode in modes:
        one = argparse.Namespace(**{**vars(args), "chunk_kv": mode, "baseline": baseline.rsplit("@", 1)[0]})
        if args.json is not None:
            one.json = args.json.with_name(f"{args.json.stem}-{mode}{args.json.suffix}")
        runs.append((mode, run_one(one)["rows"]))
    print(pair_loaded(runs, args.json, baseline, {"data": str(args.data), "k": args.k, "max_tokens": args.max_tokens,
                                                  "model": str(args.model), "follow_up": bool(args.follow_up),
                                                  "start": getattr(args, "start", 0),
                                                  "passage_words": getattr(args, "passage_words", None)}))
    return 0


def paired_baseline(baseline: str, policies: str | list[str], modes: list[str]) -> str:
    """The `policy@mode` a multi-mode run pairs against: the given one, or the per-run baseline on
    the first mode."""
    names = [p.strip() for p in policies.split(",")] if isinstance(policies, str) else list(policies)
    name, _, mode = baseline.rpartition("@") if "@" in baseline else (baseline, "", modes[0])
    if mode not in modes:
        raise InvalidPromptError(f"--baseline {baseline!r}: {mode!r} is not one of --chunk-kv {','.join(modes)}")
    if name not in names:
        if "@" in baseline:
            raise InvalidPromptError(f"--baseline {baseline!r}: {name!r} is not in --policies")
        # as a single run does: reuse when the baseline is not among the policies, else the first
        others = [p for p in names if p != "full"]
        name = "reuse" if "reuse" in names else others[0] if others else "full"
    return "full" if name == "full" else f"{name}@{mode}"
