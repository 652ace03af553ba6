"""Pair `bench fidelity` runs that differ in where the chunk KV came from (`--chunk-kv`): the same
questions, each policy renamed `policy@label`, summarized as one run, so the paired bootstrap
compares e.g. CacheBlend on KV computed alone with CacheBlend on KV warmed after neighbours.

Full prefill does not depend on the chunk KV, so its answer must be the same in every run; a
question where it is not (or that a run lacks) is left out and counted.

    python -m ragcache_lab.paired_runs OUT.json precomputed=A.json neighbours=B.json \\
        --baseline cacheblend:0.15:temp1@precomputed
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from engine_sidecar.errors import InvalidPromptError
from ragcache_lab.fidelity import fidelity_table, policy_summary, scatter_plot
from ragcache_lab.report import write_report


def _rows(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return list(json.loads(text)["rows"])
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def pair_rows(runs: list[tuple[str, list[dict[str, Any]]]]) -> tuple[list[dict[str, Any]], int]:
    """One row per question all runs hold with the same full-prefill answer; the count left out."""
    if len(runs) < 2:
        raise InvalidPromptError("give at least two runs to pair (LABEL=PATH ...)")
    by_question = [{r["question"]: r for r in rows} for _, rows in runs]
    paired: list[dict[str, Any]] = []
    dropped = 0
    for question, first in by_question[0].items():
        matches = [index.get(question) for index in by_question]
        answers = {tuple(m["policies"]["full"]["token_ids"]) for m in matches if m is not None}
        if any(m is None for m in matches) or len(answers) != 1:
            dropped += 1
            continue
        policies = {"full": first["policies"]["full"]}
        full_ttft: dict[str, float] = {}
        for (label, _), row in zip(runs, matches, strict=True):
            assert row is not None
            policies |= {f"{p}@{label}": v for p, v in row["policies"].items() if p != "full"}
            full_ttft[label] = row["policies"]["full"]["ttft_s"]
        paired.append({**first, "policies": policies, "full_ttft_s_by_run": full_ttft})
    return paired, dropped


def pair_runs(specs: list[str], out: Path | None, baseline: str) -> str:
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not Path(path).is_file():
            raise InvalidPromptError(f"{spec!r}: give LABEL=PATH of a bench fidelity JSON or .partial.jsonl")
        runs.append((label, _rows(Path(path))))
    config: dict[str, Any] = {"k": "-", "max_tokens": "-", "model": "(paired runs)"}
    first = Path(specs[0].partition("=")[2])
    if first.suffix == ".json":  # the set, k and model as the first run recorded them
        recorded = json.loads(first.read_text(encoding="utf-8")).get("config", {})
        config |= {key: recorded[key] for key in ("data", "k", "max_tokens", "model", "follow_up", "start")
                   if key in recorded}
    return pair_loaded(runs, out, baseline, {**config, "paired_from": specs})


def pair_loaded(runs: list[tuple[str, list[dict[str, Any]]]], out: Path | None, baseline: str,
                config: dict[str, Any]) -> str:
    """Runs already in memory (LABEL, rows) paired and summarized as one: the table, and with
    `out` its JSON, Markdown and plot."""
    rows, dropped = pair_rows(runs)
    if not rows:
        raise InvalidPromptError("the runs share no question with the same full-prefill answer")
    policies = [p for p in rows[0]["policies"] if all(p in r["policies"] for r in rows)]
    if baseline not in policies:
        raise InvalidPromptError(f"--baseline {baseline!r} is none of: {', '.join(policies)}")
    for r in rows:  # answers of some runs only (--no-generate elsewhere) would mix in ROUGE-L
        if not all(r["policies"][p].get("text") is not None for p in policies):
            for p in policies:
                if p != "full":
                    r["policies"][p]["text"] = None
    summary = policy_summary(rows, policies, baseline)
    for name in policies:
        if "@" in name:  # TTFT against the full prefill timed in the same run, side by side
            label = name.rsplit("@", 1)[1]
            own_full = statistics.median(r["full_ttft_s_by_run"][label] for r in rows)
            summary[name]["ttft_ratio_vs_full"] = summary[name]["ttft_median_s"] / own_full
    config = {**config, "n": len(rows), "chunk_kv": "per run (policy@LABEL)", "left_out": dropped,
              "policies": policies, "baseline": baseline}
    table = fidelity_table(summary, config) + (
        f"\n\n{dropped} question(s) left out (missing, or full's answer differs). TTFT vs full divides each "
        f"policy@LABEL by the full prefill of its own run (median over these questions); full's row is the first "
        f"run's\n")
    if out is not None:
        write_report(out, {"config": config, "policies": summary, "rows": rows}, table)
        if "data" in config:
            scatter_plot(summary, config, out.with_suffix(".png"))
    return table


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description="pair bench fidelity runs question by question (policies as policy@LABEL)")
    cli.add_argument("out", type=Path, help="where to write the paired JSON and Markdown")
    cli.add_argument("runs", nargs="+", help="LABEL=PATH of each run's JSON report or .partial.jsonl")
    cli.add_argument("--baseline", required=True, help="the policy@LABEL every other is paired against")
    ns = cli.parse_args(argv)
    try:
        print(pair_runs(ns.runs, ns.out, ns.baseline))
    except InvalidPromptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
