"""The flags of `ragcache calibrate` and `ragcache calibrate-temperature`. argparse only: building
the CLI's parser imports neither torch nor the engine; a command's module loads when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine_sidecar.engine_args import add_engine_arguments
from ragcache_integrations.policy_registry import policy_arg

# `calibrate-temperature`'s candidate T (tempT, APE) when none are given
DEFAULT_TEMPERATURES = "0.95,1,1.05,1.1,1.15,1.2,1.25"


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engine_sidecar.calibrate.ratio_search import run_calibrate

    return run_calibrate(args)


def cmd_calibrate_temperature(args: argparse.Namespace) -> int:
    from engine_sidecar.calibrate.temperature import run_calibrate_temperature

    return run_calibrate_temperature(args)


def add_calibrate_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`calibrate` and `calibrate-temperature` on the CLI's subcommands (`sub`, the action
    `add_subparsers` returned)."""
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
    add_temperature_command(sub)


def add_temperature_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    temp = sub.add_parser("calibrate-temperature",
                          help="fit the attention temperature T on reused chunk KV (tempT, APE) label-free: the T "
                               "whose teacher-forced answers are closest to full prefill's (lowest mean KL) on a "
                               "calibration split",
                          description="For each calibration question, full prefill's own greedy answer is the "
                                      "teacher; the policy runs with each candidate :tempT along it, and the T with "
                                      "the lowest mean KL(full || policy) is printed with the --policy to use, then "
                                      "checked against T = 1 on the --holdout questions after the split. No "
                                      "gold answers are read. Keep both apart from evaluation questions "
                                      "(--start).")
    temp.add_argument("--data", required=True, help="calibration set: a musique_s.json-format file, or 'fanoutqa'")
    temp.add_argument("--start", type=int, default=0, help="first record to use (default 0): keep the calibration "
                      "questions apart from those you evaluate on")
    temp.add_argument("--n", type=int, default=20, help="calibration questions (default 20)")
    temp.add_argument("--holdout", type=int, default=10,
                      help="questions right after the calibration split on which the fitted T is checked against "
                           "T = 1 (default 10; 0 skips the check): --save keeps the fit only when it holds there "
                           "(lower mean KL, agreement not lower), else T = 1")
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
                           "($RAGCACHE_HOME/calibration/), or T = 1 where the held-out check fails: engines on "
                           "this model then apply it to that policy whenever a request names no :tempT "
                           "(--fused-temperature auto, the default)")
    add_engine_arguments(temp)
    temp.set_defaults(func=cmd_calibrate_temperature)
