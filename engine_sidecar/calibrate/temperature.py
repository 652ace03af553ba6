"""`ragcache calibrate-temperature`: fit `tempT` (APE-style attention temperature on the reused
chunk KV) label-free, on a calibration split.

For each calibration question, full prefill gives its own greedy answer (the teacher: no gold
answer is read); every candidate T then runs the policy with `:tempT`, teacher-forced along that
answer, and the T with the lowest mean KL(full || policy) over the answer positions wins (top-1
agreement with full is reported beside it). Calibrate on questions you will not evaluate on
(`--start` skips the first records of the file).

A T fitted on a few questions need not carry to others (on Qwen2.5-Coder-0.5B one fitted T lowered
agreement on held-out questions), so the records right after the calibration split (`--holdout`)
check it: the fitted T and T = 1 run there, and `--save` keeps the fit only when it holds there
(lower mean KL, agreement not lower); otherwise it keeps T = 1, with both checks recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import track
from rich.table import Table

from engine_sidecar.calibrate.datasets import chunk_texts, load_dataset
from engine_sidecar.calibrate.metrics import agreement_and_kl
from engine_sidecar.calibrate.reference import full_reference
from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.calibration import save_fit
from engine_sidecar.request.fingerprint import weights_fingerprint
from ragcache_integrations.policy_registry import (
    BY_NAME,
    TEMP_RANGE,
    TEMP_TAG,
    PolicySpecError,
    parse_policy_spec,
)
from ragcache_integrations.types import ChunkedPrompt


def with_temperature(policy: str, temperature: float) -> str:
    """`policy` with `:tempT` appended in the grammar's place (`reuse:temp1.1`, `cacheblend:0.15:temp1.1`,
    the default argument spelled out for a bare name); the policy must fuse and must not carry a
    temperature already."""
    try:
        parsed = parse_policy_spec(policy)
    except PolicySpecError as exc:
        raise InvalidPromptError(str(exc)) from None
    if not BY_NAME[parsed.name].tempers:
        raise InvalidPromptError(f"policy '{policy}' reuses no chunk KV at all: a temperature has nothing to act on")
    if parsed.temperature is not None:
        raise InvalidPromptError(f"policy '{policy}' already sets {TEMP_TAG}T; give it without")
    tag = f"{TEMP_TAG}{temperature:g}"
    entry = BY_NAME[parsed.name]
    if entry.arg is None or ":" in policy:
        return f"{policy}:{tag}"
    return f"{policy}:{entry.default}:{tag}"


def parse_temperatures(text: str) -> list[float]:
    low, high = TEMP_RANGE
    bad = InvalidPromptError(f"--temperatures: a comma list of numbers in [{low:g}, {high:g}], got '{text}'")
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise bad from None
    if not values or any(not low <= v <= high for v in values):
        raise bad
    return sorted(set(values))


@dataclass
class TemperatureFit:
    policy: str
    temperatures: list[float]
    kl: dict[str, float] = field(default_factory=dict)  # mean KL(full || policy:tempT), keyed by f"{T:g}"
    agreement: dict[str, float] = field(default_factory=dict)  # mean teacher-forced top-1 agreement
    per_question_kl: dict[str, list[float]] = field(default_factory=dict)  # KL per question, in order
    questions: int = 0
    best: float = 1.0

    @property
    def best_spec(self) -> str:
        return with_temperature(self.policy, self.best)


@dataclass
class HoldoutCheck:
    """The fitted T against T = 1 on questions the fit never saw."""

    temperature: float
    questions: int
    kl: float  # mean KL(full || policy) at the fitted T
    kl_untempered: float  # the same at T = 1
    agreement: float
    agreement_untempered: float
    wins: int  # questions where the fitted T's KL is the lower

    @property
    def holds(self) -> bool:
        """Whether the fit carries: lower mean KL and agreement no lower than at T = 1 (at T = 1
        itself there is nothing to carry, so it holds)."""
        if self.temperature == 1.0:
            return True
        return self.kl < self.kl_untempered and self.agreement >= self.agreement_untempered

    def record(self, start: int) -> dict[str, Any]:
        """What the JSON and the saved fit keep of the check (`start`: its first record)."""
        return {**asdict(self), "holds": self.holds, "start": start}


def kept_temperature(fit: TemperatureFit, check: HoldoutCheck | None) -> float:
    """What `--save` keeps: the fitted T unless the held-out check says it does not carry."""
    return fit.best if check is None or check.holds else 1.0


def check_holdout(engine: Any, prompts: list[ChunkedPrompt], fit: TemperatureFit, max_tokens: int = 32,
                  progress: bool = True) -> HoldoutCheck:
    """The fitted T and T = 1 teacher-forced on held-out `prompts`, question by question."""
    temperatures = sorted({1.0, fit.best})
    held = fit_temperature(engine, prompts, fit.policy, temperatures, max_tokens, progress)
    best, one = f"{fit.best:g}", f"{1.0:g}"
    wins = sum(t < u for t, u in zip(held.per_question_kl[best], held.per_question_kl[one], strict=True))
    return HoldoutCheck(fit.best, held.questions, held.kl[best], held.kl[one], held.agreement[best],
                        held.agreement[one], wins)


def fit_temperature(engine: Any, prompts: list[ChunkedPrompt], policy: str, temperatures: list[float],
                    max_tokens: int = 32, progress: bool = True) -> TemperatureFit:
    """Mean KL and agreement per temperature over `prompts` (their chunks warmed first), and the T
    with the lowest KL."""
    specs = {t: with_temperature(policy, t) for t in temperatures}
    kls: dict[float, list[float]] = {t: [] for t in temperatures}
    agreements: dict[float, list[float]] = {t: [] for t in temperatures}
    questions = track(prompts, description="calibrating") if progress else prompts
    for prompt in questions:
        engine.warm(prompt.chunks)
        reference = full_reference(engine, prompt, max_tokens)
        answer = reference["row"]["token_ids"]
        if not answer:
            continue  # full answered with a stop token at once: nothing to follow
        ref_logprobs = reference["logits"].log_softmax(-1)
        for t, spec in specs.items():
            logits, _ = engine.teacher_forced_logits(prompt, answer[:-1], policy=spec)
            agreement, kl = agreement_and_kl(logits.float().log_softmax(-1), ref_logprobs)
            kls[t].append(kl)
            agreements[t].append(agreement)
    fit = TemperatureFit(policy, temperatures, questions=len(kls[temperatures[0]]))
    if fit.questions == 0:
        raise InvalidPromptError("no calibration question had an answer to follow (full answered with a stop token)")
    for t in temperatures:
        fit.kl[f"{t:g}"] = statistics.fmean(kls[t])
        fit.agreement[f"{t:g}"] = statistics.fmean(agreements[t])
        fit.per_question_kl[f"{t:g}"] = kls[t]
    fit.best = min(temperatures, key=lambda t: fit.kl[f"{t:g}"])
    return fit


def run_calibrate_temperature(args: argparse.Namespace) -> int:
    from engine_sidecar.engine_args import engine_from_args

    holdout_n = getattr(args, "holdout", 0)
    if args.n < 1 or args.k < 1 or args.start < 0 or holdout_n < 0:
        raise InvalidPromptError("--n and --k must be at least 1, --start and --holdout at least 0")
    temperatures = parse_temperatures(args.temperatures)
    if 1.0 not in temperatures:
        temperatures = sorted([1.0, *temperatures])  # the untempered policy is always the reference
    with_temperature(args.policy, 1.0)  # a bad policy fails before the model loads
    records = load_dataset(args.data)
    split = records[args.start : args.start + args.n]
    if not split:
        raise InvalidPromptError(f"{args.data} has no records from index {args.start}")
    held_out = records[args.start + args.n : args.start + args.n + holdout_n]
    if holdout_n and not held_out:
        raise InvalidPromptError(f"{args.data} has no records after the calibration split (index "
                                 f"{args.start + args.n} on) to check the fit on: lower --n, or --holdout 0 to "
                                 "skip the check")

    def prompts_of(rs: list[dict[str, Any]]) -> list[ChunkedPrompt]:
        return [ChunkedPrompt(chunks=chunk_texts(r, args.k), question=r["question"]) for r in rs]

    args.no_prefix_tree = True  # repeated prompts must not turn into exact prefix hits
    console = Console()
    with engine_from_args(args) as engine:
        fit = fit_temperature(engine, prompts_of(split), args.policy, temperatures, args.max_tokens)
        # T = 1 fitted: the untempered policy, nothing that could fail to carry
        check = check_holdout(engine, prompts_of(held_out), fit, args.max_tokens) \
            if held_out and fit.best != 1.0 else None
        weights_fp = weights_fingerprint(engine.model_dir)
    _print_fit(console, fit, args)
    if check is not None:
        _print_check(console, check, args.start + args.n)
    elif held_out:
        console.print("T = 1 fitted: the untempered policy, no held-out check needed")
    keep = kept_temperature(fit, check)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**asdict(fit), "best_spec": fit.best_spec, "data": str(args.data), "start": args.start,
                   "k": args.k, "max_tokens": args.max_tokens,
                   "holdout": None if check is None else check.record(args.start + args.n),
                   "kept": keep}
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {args.json}")
    if getattr(args, "save", False):
        _save(console, weights_fp, args, fit, check, keep)
    return 0


def _print_fit(console: Console, fit: TemperatureFit, args: argparse.Namespace) -> None:
    table = Table(title=f"{args.policy} on {fit.questions} questions of {args.data} from index {args.start}, "
                        "teacher-forced along full prefill's answer")
    for column in ("T", "mean KL vs full", "top-1 agreement"):
        table.add_column(column, justify="right")
    for t in fit.temperatures:
        key = f"{t:g}"
        table.add_row(key + (" (best)" if t == fit.best else ""), f"{fit.kl[key]:.4f}", f"{fit.agreement[key]:.3f}")
    console.print(table)
    console.print(f"lowest KL at T = {fit.best:g}: use --policy {fit.best_spec}")


def _print_check(console: Console, check: HoldoutCheck, start: int) -> None:
    verdict = "holds" if check.holds else "does not hold: T = 1 is kept"
    console.print(f"held out ({check.questions} questions from index {start}): T = {check.temperature:g} mean KL "
                  f"{check.kl:.4f} vs {check.kl_untempered:.4f} at T = 1, agreement {check.agreement:.3f} vs "
                  f"{check.agreement_untempered:.3f}, lower KL on {check.wins} of {check.questions}: the fit "
                  f"{verdict}", markup=False)


def _save(console: Console, weights_fp: str, args: argparse.Namespace, fit: TemperatureFit,
          check: HoldoutCheck | None, keep: float) -> None:
    name = parse_policy_spec(args.policy).name
    provenance: dict[str, Any] = {
        "fitted": f"ragcache calibrate-temperature --policy {args.policy} on {fit.questions} questions of "
                  f"{args.data} from index {args.start}, k={args.k}, dtype {args.dtype}: lowest KL at T = "
                  f"{fit.best:g}",
        "kl": fit.kl, "agreement": fit.agreement}
    if check is not None:
        provenance["held_out"] = check.record(args.start + args.n)
    path = save_fit(weights_fp, name, keep, provenance)
    console.print(f"saved T = {keep:g} for {name} on this model in {path}: requests with a {name} policy "
                  f"and no :{TEMP_TAG}T now get it", markup=False)
