"""One model's fidelity frontier across prompt shapes: the policies as rows and, per shape, what a
user judges (ROUGE-L vs full, first-token agreement, teacher-forced agreement, task F1 as a share of
full prefill's, answers flipped, TTFT as a share of full's), read from `bench fidelity` reports.

    python -m ragcache_lab.frontier --model "Qwen2.5-Coder-0.5B" MuSiQue=mq.json FanOutQA=fq.json \
        --json frontier.json

Each SHAPE=REPORT is the JSON `ragcache bench fidelity --json` (or `python -m ragcache_lab.fidelity`'s
merge) wrote; a policy a report does not hold shows as "-" under that shape."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ragcache_lab.tables import markdown_table

COLUMNS = ("ROUGE-L", "1st tok", "TF", "F1/full", "flips", "TTFT")
MISSING = "-"


def _number(value: Any, digits: int) -> str:
    return MISSING if value is None else f"{value:.{digits}f}"


def shape_cells(summary: dict[str, Any] | None) -> list[str]:
    """One policy's cells under one shape (all "-" when the report lacks the policy)."""
    if summary is None:
        return [MISSING] * len(COLUMNS)
    flips = summary.get("flips")
    flipped = (f"{flips['right_to_wrong']}/{flips['wrong_to_right']} of {flips['right_under_full']}"
               if flips else MISSING)
    ratio = summary.get("f1_vs_full")
    ttft = summary.get("ttft_ratio_vs_full")
    return [_number(summary.get("rouge_l_vs_full"), 3), _number(summary.get("first_token_agreement"), 2),
            _number(summary.get("tf_agreement"), 3), MISSING if ratio is None else f"{ratio:.0%}", flipped,
            MISSING if ttft is None else f"{ttft:.3f}x"]


def frontier(model: str, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The frontier as plain data: per shape its question count and each policy's summary."""
    policies: list[str] = []
    for report in reports.values():
        policies += [p for p in report["policies"] if p not in policies]
    return {"model": model, "policies": policies,
            "shapes": {shape: {"n": report["config"].get("n"), "policies": report["policies"]}
                       for shape, report in reports.items()}}


def frontier_table(data: dict[str, Any]) -> str:
    shapes = data["shapes"]
    header = ["policy"] + [f"{shape} {column}" for shape in shapes for column in COLUMNS]
    rows = [[policy] + [cell for shape in shapes.values() for cell in shape_cells(shape["policies"].get(policy))]
            for policy in data["policies"]]
    counts = ", ".join(f"{shape} n={info['n']}" for shape, info in shapes.items())
    legend = ("flips: questions full prefill answers right (F1 >= 0.5 vs gold) that the policy answers wrong / "
              "the reverse, of those full gets right; TTFT: median time to first token over full prefill's")
    return f"{data['model']} ({counts})\n\n{markdown_table(header, rows)}\n\n{legend}"


def _shape_report(arg: str) -> tuple[str, dict[str, Any]]:
    shape, sep, path = arg.rpartition("=")  # a shape name may hold "=" ("k=10"), a path rarely does
    if not sep or not shape or not path:
        raise SystemExit(f"expected SHAPE=REPORT.json, got {arg!r}")
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"cannot read {path}: {exc}") from None
    if "policies" not in report or "config" not in report:
        raise SystemExit(f"{path} is not a `bench fidelity` report (no 'policies' and 'config')")
    return shape, report


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m ragcache_lab.frontier",
                                  description="one model's fidelity frontier across prompt shapes, from "
                                              "`bench fidelity` JSON reports")
    cli.add_argument("reports", nargs="+", metavar="SHAPE=REPORT.json",
                     help="a shape's name and the report measured on it, e.g. MuSiQue=mq.json")
    cli.add_argument("--model", required=True, help="the model's name, for the title")
    cli.add_argument("--json", type=Path, help="also write the frontier as JSON here")
    ns = cli.parse_args(argv)
    data = frontier(ns.model, dict(_shape_report(arg) for arg in ns.reports))
    if ns.json is not None:
        ns.json.write_text(json.dumps(data, indent=1), encoding="utf-8")
    print(frontier_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
