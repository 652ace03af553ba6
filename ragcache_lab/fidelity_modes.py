"""`ragcache bench fidelity` over one or several models and chunk-KV modes: one run per model and
mode; several modes are paired question by question into one table (each policy as
`policy@mode`), so one command shows e.g. the default on KV warmed after neighbours against
CacheBlend on KV computed alone; several models (`--models`) add one table with a block per model
over the same questions."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from engine_sidecar.errors import InvalidPromptError
from ragcache_lab.fidelity import run_one
from ragcache_lab.paired_runs import pair_loaded
from ragcache_lab.policy_specs import BASELINE


def run_fidelity(args: argparse.Namespace) -> int:
    """One run per model (`--models`, else `--model`) and `--chunk-kv` mode; several modes are
    paired into one table per model; `--models` adds one table over the models (also for one)."""
    models = getattr(args, "models", None)
    if not models:
        run_modes(args)
    else:
        from engine_sidecar.model.prepare import resolve_model_dir

        for model in models:  # every model found before the first run starts (each run takes long)
            resolve_model_dir(model)
        run_models = []
        for model in models:
            one = argparse.Namespace(**{**vars(args), "model": model})
            if args.json is not None:
                one.json = args.json.with_name(f"{args.json.stem}-{file_label(model)}{args.json.suffix}")
            run_models.append((model, run_modes(one)))
        table = models_table(run_models, args)
        print(table)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"models": {m: [{"chunk_kv": mode, "policies": r["policies"],
                                                              "config": r["config"]} for mode, r in reports]
                                                         for m, reports in run_models}}, indent=1))
            args.json.with_suffix(".md").write_text(table + "\n")
    return 0


def file_label(model: str) -> str:
    """A model's name in a file name: a registry name as it is, a folder by its last part."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name or model)


def models_table(run_models: list[tuple[str, list[tuple[str, dict[str, Any]]]]], args: argparse.Namespace) -> str:
    """One block per model: each policy's agreement with full prefill and task accuracy beside
    its TTFT ratio, per chunk-KV mode."""
    lines = [f"fidelity per model: {args.data}, k={args.k}, {args.max_tokens} tokens, the same questions for "
             "every model", "",
             "| model | chunk KV | questions | policy | ROUGE-L vs full | first token | TF agreement | F1 (full's) "
             "| F1 vs full | flipped right→wrong / wrong→right | TTFT vs full |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, reports in run_models:
        for mode, report in reports:
            full_f1 = report["policies"].get("full", {}).get("f1")
            for name, m in report["policies"].items():
                lines.append(
                    f"| {model} | {mode} | {report['config']['n']} | {name} | {_num(m.get('rouge_l_vs_full'))} "
                    f"| {_num(m.get('first_token_agreement'), 2)} | {_num(m.get('tf_agreement'))} "
                    f"| {_num(m.get('f1'))} ({_num(full_f1)}) | {_num(m.get('f1_vs_full'))} "
                    f"| {_flipped(m.get('flips'))} "
                    f"| {_num(m.get('ttft_ratio_vs_full'))} |")
    return "\n".join(lines)


def _flipped(flips: dict[str, int] | None) -> str:
    return "-" if not flips else f"{flips['right_to_wrong']} / {flips['wrong_to_right']}"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run_modes(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """One model's runs, one per `--chunk-kv` mode, paired into one table when there are several:
    each mode's report."""
    modes = [args.chunk_kv] if isinstance(args.chunk_kv, str) else list(args.chunk_kv)
    if len(modes) == 1:
        args.chunk_kv = modes[0]
        if "@" in getattr(args, "baseline", BASELINE):
            args.baseline = paired_baseline(args.baseline, args.policies, modes).rsplit("@", 1)[0]
        return [(modes[0], run_one(args))]
    baseline = paired_baseline(getattr(args, "baseline", BASELINE), args.policies, modes)
    reports: list[tuple[str, dict[str, Any]]] = []
    for mode in modes:
        one = argparse.Namespace(**{**vars(args), "chunk_kv": mode, "baseline": baseline.rsplit("@", 1)[0]})
        if args.json is not None:
            one.json = args.json.with_name(f"{args.json.stem}-{mode}{args.json.suffix}")
        reports.append((mode, run_one(one)))
    runs = [(mode, report["rows"]) for mode, report in reports]
    print(pair_loaded(runs, args.json, baseline, {"data": str(args.data), "k": args.k, "max_tokens": args.max_tokens,
                                                  "model": str(args.model), "follow_up": bool(args.follow_up),
                                                  "start": getattr(args, "start", 0),
                                                  "passage_words": getattr(args, "passage_words", None)}))
    return reports


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
