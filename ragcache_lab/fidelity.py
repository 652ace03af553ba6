"""`ragcache bench fidelity`: answer quality and TTFT of each policy against full prefill.

Policies run interleaved per question (these machines are shared and noisy, so only ratios
measured side by side mean anything). All chunks are warmed first, so every policy but `full`
sees 100% chunk hits. transformers' own prefill of the same token ids is timed too, to show the
engine's `full` is an honest baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import track

from engine_sidecar.calibrate.datasets import chunk_texts
from engine_sidecar.calibrate.metrics import agreement_and_kl, rouge_l
from engine_sidecar.calibrate.reference import capture_last_hidden, full_pass, full_reference, prefill_hidden
from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.policies import Policy
from engine_sidecar.model.runner import ModelRunner
from ragcache_integrations.types import ChunkedPrompt, SamplingParams
from ragcache_lab.divergence import layer_divergence
from ragcache_lab.metrics import bootstrap_ci, exact_match, token_f1
from ragcache_lab.oracle_policy import OraclePolicy
from ragcache_lab.policy_specs import BASELINE, is_oracle, oracle_ratio
from ragcache_lab.report import write_report
from ragcache_lab.tables import markdown_table, table_lines


def _transformers_prefill_s(model, token_ids: list[int]) -> float:
    import torch

    ids = torch.tensor([token_ids])
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids)
        return time.perf_counter() - start


def rotated(chunks: list[str]) -> list[str]:
    """The same chunks in another order (last first): the context Cache-Craft variants are
    recorded in before a question is asked with its own order."""
    return chunks[-1:] + chunks[:-1] if len(chunks) > 1 else chunks


def craft_prompt(record: dict[str, Any], k: int, foreign: dict[str, Any] | None = None) -> ChunkedPrompt:
    """The request that records a question's Cache-Craft variants before it is asked: its passages
    in another order (last first), or, with a `foreign` record, that record's question over its
    passages interleaved with these (foreign first), so each variant follows passages the measured
    prompt does not hold."""
    own = chunk_texts(record, k)
    if foreign is None:
        return ChunkedPrompt(chunks=rotated(own), question=record["question"])
    others = chunk_texts(foreign, k)
    mixed = [text for pair in itertools.zip_longest(others, own) for text in pair if text is not None]
    return ChunkedPrompt(chunks=mixed, question=foreign["question"])


def prepare_chunks(engine: Any, record: dict[str, Any], k: int, policies: list[str],
                   chunk_kv: str = "precomputed", neighbours: tuple[int, Any] = (0, None),
                   craft_foreign: dict[str, Any] | None = None) -> None:
    # warmed per question (not all up front) so a RAM tier smaller than the whole set cannot
    # turn a policy's lookups into misses
    if chunk_kv == "neighbours":
        engine.warm(chunk_texts(record, k), neighbours=neighbours[0], pool=neighbours[1])
    elif chunk_kv == "in-context":
        # misses computed in place by a request with the chunks in another order: the KV a live
        # stream leaves behind (the question then reuses it in its own order, fused)
        engine.generate(ChunkedPrompt(chunks=rotated(chunk_texts(record, k)), question=record["question"]),
                        {"max_tokens": 1}, policy="cacheblend")
    else:
        engine.warm(chunk_texts(record, k))
    if any(p.startswith("cachecraft") for p in policies):
        # Cache-Craft keeps KV computed inside requests: a request holding these chunks records the
        # variants the measured question then reuses
        engine.generate(craft_prompt(record, k, craft_foreign), {"max_tokens": 1}, policy="cachecraft")


@dataclass(frozen=True)
class RunPlan:
    """What one run measures, settled from the arguments before the engine loads (so a bad
    argument fails fast)."""

    records: list[dict[str, Any]]
    start: int
    policies: list[str]
    sampling: SamplingParams
    no_generate: bool
    budget_s: float
    started: float
    partial: Path | None


@dataclass
class _Measuring:
    """What the questions are measured with, beside the engine: transformers' model for its own
    prefill time, the other-precision runner of the noise floor, and the neighbour index."""

    engine: Any
    hf_model: Any = None
    noise: ModelRunner | None = None
    noise_name: str | None = None
    neighbours: tuple[int, Any] = (0, None)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One `bench fidelity` run with a single chunk-KV mode: prints its table, writes its report
    with --json, and returns the report."""
    from engine_sidecar.engine_args import engine_from_args

    console = Console()
    plan = plan_run(args)
    # Each question is asked once per policy: a CP-Tree would turn later policies' chunks into
    # exact prefix hits and blur what each fusion policy does on its own.
    args.no_prefix_tree = True
    with _own_disk_tier(args) as engine_args, engine_from_args(engine_args) as engine:
        measuring = _start_measuring(engine_args, engine, plan.records, console)
        rows = _measure_questions(engine_args, plan, measuring, console)
    return _report(args, plan, rows, measuring.noise_name, console)


@contextlib.contextmanager
def _own_disk_tier(args: argparse.Namespace) -> Iterator[argparse.Namespace]:
    """The arguments with the disk tier in a new, empty folder (inside --cache-dir when given),
    removed after the run. The store serves a stored entry for the same chunk whatever made it, so
    a disk tier shared with an earlier run, or with the run of another --chunk-kv mode, would hand
    one mode's KV (say, warmed after neighbours) to the next mode's questions."""
    if getattr(args, "no_disk", False):
        yield args
        return
    parent = getattr(args, "cache_dir", None)
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="ragcache-bench-fidelity-", dir=parent))
    try:
        yield argparse.Namespace(**{**vars(args), "cache_dir": folder})
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def plan_run(args: argparse.Namespace) -> RunPlan:
    """The records and policies to measure, with every argument checked, and an empty
    partial-results file started."""
    from engine_sidecar.calibrate.datasets import load_dataset
    from ragcache_lab.recut import recut_records

    start = getattr(args, "start", 0)
    if args.n < 1 or args.k < 1 or start < 0:
        raise InvalidPromptError("--n and --k must be at least 1 and --start at least 0")
    records = load_dataset(args.data)[start : start + args.n]
    if getattr(args, "passage_words", None) is not None:
        records = recut_records(records, args.passage_words)
    if not records:
        raise InvalidPromptError(f"{args.data} has no records from index {start}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "full" not in policies:
        policies.insert(0, "full")
    no_generate = bool(getattr(args, "no_generate", False))
    plan = RunPlan(records=records, start=start, policies=policies,
                    sampling=SamplingParams(max_tokens=args.max_tokens), no_generate=no_generate,
                    budget_s=60.0 * (getattr(args, "max_minutes", None) or 0.0), started=time.perf_counter(),
                    partial=args.json.with_suffix(".partial.jsonl") if args.json else None)
    if plan.partial is not None:
        plan.partial.parent.mkdir(parents=True, exist_ok=True)
        plan.partial.write_text("")
    if no_generate and args.follow_up:
        raise InvalidPromptError("--no-generate measures along full prefill's answer: not available with --follow-up")
    if args.follow_up and (any(is_oracle(p) for p in policies) or getattr(args, "noise_floor", False)):
        raise InvalidPromptError("oracle policies and --noise-floor need full prefill of the measured prompt: "
                                 "not available with --follow-up")
    return plan


def _start_measuring(args: argparse.Namespace, engine: Any, records: list[dict[str, Any]],
                     console: Console) -> _Measuring:
    """Loads what the measurements need beside the engine and takes first-request costs off the
    clock."""
    measuring = _Measuring(engine)
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        measuring.hf_model = AutoModelForCausalLM.from_pretrained(str(engine.model_dir),
                                                                  dtype=engine.model_runner().dtype).eval()
    if temperatures := engine.attention_temperatures():
        fitted = ", ".join(f"{name} T={t:g}" for name, t in sorted(temperatures.items()))
        console.print(f"a policy without :temp<T> runs with this model's attention temperature ({fitted}; "
                      "--fused-temperature off for none)", markup=False)
    if getattr(args, "noise_floor", False):
        # full prefill in the other precision: the same weights, no cache
        other = "bfloat16" if engine.model_runner().dtype == torch.float32 else "float32"
        measuring.noise = ModelRunner.load(engine.model_dir, device=str(engine.model_runner().device), dtype=other)
        measuring.noise_name = f"full@{'bf16' if other == 'bfloat16' else 'fp32'}"
    # first-request costs off the clock, on text outside the data set: a passage of the set
    # would be stored in place here and reused exactly by its question
    engine.generate(ChunkedPrompt(chunks=["A warm-up passage, not part of any record."], question="warm-up"),
                    {"max_tokens": 2}, policy="full")
    if getattr(args, "chunk_kv", "precomputed") == "neighbours":
        # the corpus: every passage of the measured records, not only the K each question uses
        corpus = [text for rec in records for text in chunk_texts(rec, len(rec["ctxs"]))]
        measuring.neighbours = (args.neighbours, engine.neighbour_pool(corpus))
    return measuring


def _measure_questions(args: argparse.Namespace, plan: RunPlan, measuring: _Measuring,
                       console: Console) -> list[dict[str, Any]]:
    """One row per question, each kept in the partial file as soon as it is measured, until the
    records or --max-minutes run out."""
    records = plan.records
    rows: list[dict[str, Any]] = []
    for i, record in enumerate(track(records, description="answering", console=console)):
        follow = records[i + 1] if args.follow_up and i + 1 < len(records) else None
        if args.follow_up and follow is None:
            break  # the last record has no next question to follow up with
        if plan.budget_s and rows and time.perf_counter() - plan.started > plan.budget_s:
            console.print(f"--max-minutes reached after {len(rows)} questions")
            break
        row = _measure_question(args, plan, measuring, i, record, follow)
        rows.append(row)
        if plan.partial is not None:  # one line per question, so a stopped run keeps what it measured
            with plan.partial.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
    return rows


def _measure_question(args: argparse.Namespace, plan: RunPlan, measuring: _Measuring, i: int,
                      record: dict[str, Any], follow: dict[str, Any] | None) -> dict[str, Any]:
    """Every policy on one question (with --follow-up: on the next record's question, asked as
    turn 2 after this one), then the diagnostics measured along full prefill's answer."""
    engine = measuring.engine
    for rec in (record, follow) if follow is not None else (record,):
        foreign = None
        if getattr(args, "craft_context", "rotated") == "foreign" and len(plan.records) > 1:
            foreign = plan.records[(i + 1) % len(plan.records)]
        prepare_chunks(engine, rec, args.k, plan.policies, getattr(args, "chunk_kv", "precomputed"),
                       measuring.neighbours, foreign)
    prompt = ChunkedPrompt(chunks=chunk_texts(record, args.k), question=record["question"])
    measured = follow or record
    row: dict[str, Any] = {"index": plan.start + i, "question": measured["question"],
                           "answers": measured.get("answers", []), "policies": {}}
    reference = None
    if follow is None:
        # one full prefill on the engine's runner gives full's answer, the teacher-forced
        # reference along it, the per-layer reference hidden states and the oracle's KV
        reference = full_reference(engine, prompt, args.max_tokens)
        row["policies"]["full"] = reference["row"]
    for policy in plan.policies:
        if follow is None and (policy == "full" or plan.no_generate):
            continue  # full: from full_reference; --no-generate: teacher-forced only
        spec = make_policy(policy, reference)
        result = _generate(engine, prompt, follow, spec, plan.sampling, args.k, f"fidelity-{i}-{policy}")
        row["policies"][policy] = _generated_entry(result)
    if reference is not None:
        _diagnose(args, plan, measuring, prompt, row, reference)
    return row


def _generate(engine: Any, prompt: ChunkedPrompt, follow: dict[str, Any] | None, spec: str | Policy,
              sampling: SamplingParams, k: int, conversation: str) -> Any:
    """The measured generation under one policy: the prompt itself, or with a follow-up record a
    two-turn conversation whose turn 2 (the next record's question over its own passages) is
    measured."""
    if follow is None:
        return engine.generate(prompt, sampling, policy=spec)
    engine.generate(prompt.model_copy(update={"conversation_id": conversation}), sampling, policy=spec)
    return engine.generate(ChunkedPrompt(chunks=chunk_texts(follow, k), question=follow["question"],
                                         conversation_id=conversation), sampling, policy=spec)


def _generated_entry(result: Any) -> dict[str, Any]:
    """A generated answer's entry in the question's row, with what its policy decided."""
    stats = result.stats
    return {"text": result.text, "first_token": result.token_ids[:1], "token_ids": result.token_ids,
            "ttft_s": stats.ttft_s, "computed_fraction": stats.computed_fraction,
            "recompute_share": stats.tokens_recomputed / max(1, stats.tokens_recomputed + stats.tokens_reused),
            "prompt_tokens": stats.prefill_tokens_total,
            "stage_s": {k: v for k, v in stats.stage_times.items() if k in STAGES}, **policy_details(stats.policy_decisions)}


def _diagnose(args: argparse.Namespace, plan: RunPlan, measuring: _Measuring, prompt: ChunkedPrompt,
              row: dict[str, Any], reference: dict[str, Any]) -> None:
    """What needs full prefill of the measured prompt: teacher-forced agreement and divergence,
    the noise floor and transformers' prefill time."""
    engine = measuring.engine
    if plan.no_generate or not getattr(args, "no_teacher_forced", False):
        divergence = not getattr(args, "no_divergence", False)
        teacher_forced(engine, prompt, row, plan.policies, reference, divergence)
    if measuring.noise is not None:
        noise_floor(measuring.noise, engine, prompt, row, reference, measuring.noise_name, args.max_tokens)
    if measuring.hf_model is not None:
        ids = engine.prompt_token_ids(prompt)
        row["transformers_prefill_s"] = _transformers_prefill_s(measuring.hf_model, ids)


def _report(args: argparse.Namespace, plan: RunPlan, rows: list[dict[str, Any]], noise_name: str | None,
            console: Console) -> dict[str, Any]:
    """Summarizes the rows, prints the table and, with --json, writes the report and its plot."""
    policies = plan.policies
    measured = policies + [noise_name] if noise_name and rows and noise_name in rows[0]["policies"] else policies
    if not rows:
        raise InvalidPromptError("--follow-up needs at least two questions (--n 2 or more)")
    summary = policy_summary(rows, measured, getattr(args, "baseline", BASELINE))
    config = _run_config(args, plan, rows, noise_name)
    table = fidelity_table(summary, config)
    print(table)
    report = {"config": config, "policies": summary, "rows": rows}
    if args.json:
        written = write_report(args.json, report, table)
        plot = scatter_plot(summary, config, args.json.with_suffix(".png"))
        console.print("wrote " + ", ".join(str(p) for p in [*written, *([plot] if plot else [])]))
    return report


def _run_config(args: argparse.Namespace, plan: RunPlan, rows: list[dict[str, Any]],
                noise_name: str | None) -> dict[str, Any]:
    """The report's config: what was asked for and what was measured, so runs can be paired."""
    config = {"data": str(args.data), "n": len(rows), "k": args.k, "max_tokens": args.max_tokens,
              "follow_up": bool(args.follow_up),
              "model": str(args.model), "dtype": args.dtype, "device": args.device, "policies": plan.policies,
              "convention": args.convention, "chunk_kv": getattr(args, "chunk_kv", "precomputed"),
              "craft_context": getattr(args, "craft_context", "rotated"),
              "neighbours": args.neighbours if getattr(args, "chunk_kv", "") == "neighbours" else None,
              "noise_floor": noise_name, "generated": not plan.no_generate, "n_requested": args.n,
              "start": plan.start, "max_minutes": getattr(args, "max_minutes", None),
              "passage_words": getattr(args, "passage_words", None)}
    transformers_times = [r["transformers_prefill_s"] for r in rows if "transformers_prefill_s" in r]
    if transformers_times:
        config["transformers_prefill_median_s"] = statistics.median(transformers_times)
    return config


def make_policy(spec: str, reference: dict[str, Any] | None) -> str | Policy:
    """The policy to hand the engine: the spec itself; for oracle:<r> a Policy object holding
    full prefill's KV of this very prompt."""
    if not is_oracle(spec):
        return spec
    if reference is None:
        raise InvalidPromptError("oracle policies need full prefill of the measured prompt")
    return OraclePolicy(oracle_ratio(spec), reference["keys_pre"], reference["values"])


def policy_details(decisions: dict[str, Any]) -> dict[str, Any]:
    """What a policy decided on the request it just ran (its stats' `policy_decisions`), for the
    question's row: the oracle's share of picks at chunk heads; the gate's first-token margin
    under reuse and whether it spent its budget (the gate's computed share varies per question
    with that decision)."""
    if "head_share" in decisions:
        return {"head_share": decisions["head_share"]}
    if "escalated" in decisions:
        return {"escalated": decisions["escalated"], "margin": decisions["margin"]}
    return {}


def teacher_forced(engine: Any, prompt: ChunkedPrompt, row: dict[str, Any], policies: list[str],
                   reference: dict[str, Any], divergence: bool = True) -> None:
    """Each policy's next-token distributions along full prefill's own answer (fed back token by
    token): top-1 agreement with full's and mean KL(full || policy) per answer position; with
    `divergence`, the last prompt token's hidden state per layer against full prefill's (read
    during the same prefill)."""
    answer = row["policies"]["full"]["token_ids"]
    if not answer:
        return
    ref_logprobs = reference["logits"].log_softmax(-1)
    layers = engine.model_runner().num_layers
    for policy in policies:
        if policy == "full":
            target = row["policies"][policy]
            logprobs, hidden = ref_logprobs, reference["hidden"]
        else:
            stamps: list[float] = []
            spec = make_policy(policy, reference)
            with capture_last_hidden(engine.model_runner(), stamps) as captured:
                started = time.perf_counter()
                logits, stats = engine.teacher_forced_logits(prompt, answer[:-1], policy=spec)
            logprobs, hidden = logits.float().log_softmax(-1), prefill_hidden(captured, layers)
            if policy not in row["policies"]:
                # not generated (--no-generate): what this pass shows instead. Its first position
                # is greedy's first token; its prefill (to the last layer) stands in for TTFT
                row["policies"][policy] = {
                    "text": None, "first_token": [int(logits[0].argmax())], "token_ids": None,
                    "ttft_s": stamps[layers - 1] - started, "computed_fraction": stats.computed_fraction,
                    "recompute_share": stats.tokens_recomputed / max(1, stats.tokens_recomputed + stats.tokens_reused),
                    "prompt_tokens": stats.prefill_tokens_total}
            target = row["policies"][policy]
            target.update(policy_details(stats.policy_decisions))
        target["tf_agreement"], target["tf_kl"] = agreement_and_kl(logprobs, ref_logprobs)
        if divergence:
            target["divergence"] = layer_divergence(hidden, reference["hidden"])


def noise_floor(runner: Any, engine: Any, prompt: ChunkedPrompt, row: dict[str, Any], reference: dict[str, Any],
                name: str, max_tokens: int) -> None:
    """Full prefill in the other precision (`runner`): its own greedy answer (ROUGE-L and first
    token vs full's), then teacher-forced along full's answer (agreement, KL) and its per-layer
    hidden state against full's: how much of a policy's deviation precision alone produces."""
    ids = engine.prompt_token_ids(prompt)
    answer = row["policies"]["full"]["token_ids"]
    other = full_pass(runner, ids, max_tokens, engine.eos_ids, follow=answer[:-1] if answer else None)
    entry: dict[str, Any] = {"text": engine.decode(other["token_ids"]), "first_token": other["token_ids"][:1],
                             "token_ids": other["token_ids"], "ttft_s": other["ttft_s"], "computed_fraction": 1.0,
                             "recompute_share": 0.0, "prompt_tokens": len(ids)}
    if answer:
        entry["tf_agreement"], entry["tf_kl"] = agreement_and_kl(other["follow_logits"].log_softmax(-1),
                                                           reference["logits"].log_softmax(-1))
        entry["divergence"] = layer_divergence(other["hidden"], reference["hidden"])
    row["policies"][name] = entry


def scatter_plot(summary: dict[str, dict[str, float]], config: dict[str, Any], path: Path) -> Path | None:
    """Quality (ROUGE-L vs full) against TTFT (vs full), one labelled point per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is not installed: the table and JSON still stand
        return None
    # ROUGE-L when every policy generated; teacher-forced agreement with --no-generate
    key = "rouge_l_vs_full" if all(m.get("rouge_l_vs_full") is not None for m in summary.values()) else "tf_agreement"
    if not all(m.get(key) is not None for m in summary.values()):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for i, (name, m) in enumerate(summary.items()):
        ax.scatter(m["ttft_ratio_vs_full"], m[key], s=36)
        share = "all computed" if name == "full" else f"{m['recompute_share']:.2f}"
        # alternate label sides so neighbouring points stay readable
        ax.annotate(f"{name} ({share})", (m["ttft_ratio_vs_full"], m[key]),
                    textcoords="offset points", xytext=(6, 4) if i % 2 else (6, -11), fontsize=8)
    ax.set_xlabel("TTFT / full prefill TTFT (median, lower is faster)")
    ax.set_ylabel("ROUGE-L of the answer vs full prefill's" if key == "rouge_l_vs_full"
                  else "teacher-forced top-1 agreement with full prefill")
    turn = ", turn 2 of conversations" if config.get("follow_up") else ""
    ax.set_title(f"{Path(str(config['data'])).stem}: {config['n']} questions, k={config['k']}{turn} "
                 "(recompute share in brackets)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# where a generated answer's time to first token goes (the prefill's split exists on a CPU only)
STAGES = {"plan_s": "plan", "prefill_setup_s": "setup", "prefill_rotate_s": "rotate", "prefill_probe_s": "probe",
          "prefill_dense_layers_s": "dense layers", "prefill_sparse_layers_s": "sparse layers",
          "prefill_logits_s": "logits", "commit_s": "commit"}


def stage_medians(entries: list[dict[str, Any]]) -> dict[str, float]:
    """Median milliseconds per stage over the entries that carry one (0 where a question's
    request ran no such stage)."""
    timed = [e["stage_s"] for e in entries if e.get("stage_s")]
    seen = [k for k in STAGES if any(k in t for t in timed)]
    return {k: 1e3 * statistics.median(t.get(k, 0.0) for t in timed) for k in seen}


def stage_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    timed = {name: m["stage_ms"] for name, m in summary.items() if m.get("stage_ms")}
    columns = [k for k in STAGES if any(k in t for t in timed.values())]
    if not any(k.startswith("prefill_") for k in columns):
        return []
    cells = [[name, *(f"{stages.get(k, 0.0):.1f}" for k in columns)] for name, stages in timed.items()]
    return ["", "Where the time to first token goes (median ms per stage of the generated answers; dense "
            "layers start with most tokens active, as CacheBlend's first and check layers):", "",
            *table_lines(["policy", *(STAGES[k] for k in columns)], cells)]


def policy_summary(rows: list[dict[str, Any]], policies: list[str],
              baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    full_ttft = statistics.median(r["policies"]["full"]["ttft_s"] for r in rows)
    out: dict[str, dict[str, Any]] = {}
    base = baseline if baseline in policies else "reuse" if "reuse" in policies else None
    forced = [r for r in rows if all("tf_agreement" in r["policies"][p] for p in policies)]
    for policy in policies:
        per = [(r, r["policies"][policy]) for r in rows]
        ttft = statistics.median(p["ttft_s"] for _, p in per)
        # answers generated (not with --no-generate, where only full's is)
        texts = [(r, p) for r, p in per if p.get("text") is not None]
        rouge = [rouge_l(p["text"], r["policies"]["full"]["text"]) for r, p in texts]
        rouge_lo, rouge_hi = bootstrap_ci(rouge) if rouge else (None, None)
        out[policy] = {
            "em": statistics.mean(exact_match(p["text"], r["answers"]) for r, p in texts) if texts else None,
            "f1": statistics.mean(token_f1(p["text"], r["answers"]) for r, p in texts) if texts else None,
            "rouge_l_vs_full": statistics.mean(rouge) if rouge else None,
            "rouge_l_ci95": [rouge_lo, rouge_hi],
            **task_accuracy(texts),
            "first_token_agreement": statistics.mean(
                float(p["first_token"] == r["policies"]["full"]["first_token"]) for r, p in per),
            "ttft_median_s": ttft,
            "ttft_ratio_vs_full": ttft / full_ttft,
            "computed_fraction": statistics.mean(p["computed_fraction"] for _, p in per),
            "recompute_share": statistics.mean(p.get("recompute_share", 0.0) for _, p in per),
            "stage_ms": stage_medians([p for _, p in per]),
        }
        if forced:
            agreement = [r["policies"][policy]["tf_agreement"] for r in forced]
            out[policy]["tf_agreement"] = statistics.mean(agreement)
            out[policy]["tf_agreement_ci95"] = list(bootstrap_ci(agreement))
            out[policy]["tf_kl"] = statistics.mean(r["policies"][policy]["tf_kl"] for r in forced)
            if base is not None and policy != base:
                # paired: the per-question difference, so question difficulty cancels out
                diffs = [r["policies"][policy]["tf_agreement"] - r["policies"][base]["tf_agreement"] for r in forced]
                out[policy]["tf_agreement_delta"] = {"vs": base, "mean": statistics.mean(diffs),
                                                     "ci95": list(bootstrap_ci(diffs))}
        diverged = [r["policies"][policy]["divergence"] for r in rows if "divergence" in r["policies"][policy]]
        if diverged:
            # per layer, averaged over questions
            out[policy]["divergence"] = {
                metric: [statistics.mean(d[metric][layer] for d in diverged) for layer in range(len(diverged[0][metric]))]
                for metric in ("cosine_distance", "relative_l2")}
        heads = [r["policies"][policy]["head_share"] for r in rows if "head_share" in r["policies"][policy]]
        if heads:
            out[policy]["oracle_head_share"] = statistics.mean(heads)
        gated = [p for _, p in per if "escalated" in p]
        if gated:
            out[policy]["gate"] = gate_summary(gated)
    return out


RIGHT_F1 = 0.5  # an answer counts as right at token F1 >= 0.5 against the gold answers


def task_accuracy(texts: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The policy's answers judged against gold as full prefill's are: F1 as a fraction of full
    prefill's (the papers' measure), and the answers that flipped: right under full prefill (F1 >=
    RIGHT_F1) and wrong under the policy, and the reverse."""
    scored = [(token_f1(p["text"], r["answers"]), token_f1(r["policies"]["full"]["text"], r["answers"]))
              for r, p in texts if r["policies"]["full"].get("text") is not None]  # (policy's F1, full's F1)
    if not scored:
        return {}
    full_f1 = statistics.mean(full for _, full in scored)
    return {"f1_vs_full": statistics.mean(ours for ours, _ in scored) / full_f1 if full_f1 > 0 else None,
            "flips": {"right_to_wrong": sum(full >= RIGHT_F1 > ours for ours, full in scored),
                      "wrong_to_right": sum(ours >= RIGHT_F1 > full for ours, full in scored),
                      "right_under_full": sum(full >= RIGHT_F1 for _, full in scored), "questions": len(scored)}}


def gate_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A gate policy's decisions over the questions: the share escalated, the median margin, and
    the mean computed share on each side of the decision (the overall mean is `computed_fraction`,
    the average cost)."""
    escalated = [e for e in entries if e["escalated"]]
    confident = [e for e in entries if not e["escalated"]]
    margins = [e["margin"] for e in entries if e.get("margin") is not None]
    return {"escalated_share": len(escalated) / len(entries), "questions": len(entries),
            "margin_median": statistics.median(margins) if margins else None,
            "computed_escalated": statistics.mean(e["computed_fraction"] for e in escalated) if escalated else None,
            "computed_confident": statistics.mean(e["computed_fraction"] for e in confident) if confident else None}


POLICY_HEADER = ["policy", "EM", "F1", "F1 vs full", "flipped: right→wrong / wrong→right (of right under full)",
                 "ROUGE-L vs full (95% CI)", "first-token agreement", "TTFT median (s)", "TTFT vs full", "computed",
                 "recompute share"]


def fidelity_table(summary: dict[str, dict[str, Any]], config: dict[str, Any]) -> str:
    turn = "; turn 2 of a two-turn conversation (the next record's question)" if config.get("follow_up") else ""
    lines = [
        f"fidelity: {config['n']} questions{f' from record {s}' if (s := config.get('start')) else ''}, "
        f"{config['k']} chunks each{f' (re-cut to ~{w} words)' if (w := config.get('passage_words')) else ''}, "
        f"{config['max_tokens']} tokens, "
        f"model {config['model']}, chunk KV {config.get('chunk_kv', 'precomputed')}"
        f"{f' ({n} neighbours)' if (n := config.get('neighbours')) else ''}{turn}",
        "",
        markdown_table(POLICY_HEADER, [_policy_cells(name, m) for name, m in summary.items()]),
    ]
    lines += teacher_forced_table(summary)
    lines += gate_table(summary)
    lines += stage_table(summary)
    lines += divergence_table(summary)
    if "transformers_prefill_median_s" in config:
        lines.append("")
        lines.append(f"transformers' own prefill of the same prompts: median "
                     f"{config['transformers_prefill_median_s']:.3f} s; engine `full` TTFT median "
                     f"{summary['full']['ttft_median_s']:.3f} s (ratio "
                     f"{summary['full']['ttft_median_s'] / config['transformers_prefill_median_s']:.2f})")
    return "\n".join(lines)


def _policy_cells(name: str, m: dict[str, Any]) -> list[str]:
    if m["rouge_l_vs_full"] is None:  # not generated (--no-generate)
        quality = ["-"] * 5
    else:
        lo, hi = m.get("rouge_l_ci95", (m["rouge_l_vs_full"], m["rouge_l_vs_full"]))
        flips = m.get("flips")
        flipped = (f"{flips['right_to_wrong']} / {flips['wrong_to_right']} (of {flips['right_under_full']})"
                   if flips else "-")
        quality = [f"{m['em']:.2f}", f"{m['f1']:.3f}", _or_dash(m.get("f1_vs_full")), flipped,
                   f"{m['rouge_l_vs_full']:.3f} ({lo:.2f}-{hi:.2f})"]
    return [name, *quality, f"{m['first_token_agreement']:.2f}", f"{m['ttft_median_s']:.3f}",
            f"{m['ttft_ratio_vs_full']:.3f}", f"{m['computed_fraction']:.3f}", f"{m['recompute_share']:.3f}"]


def teacher_forced_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    forced = {name: m for name, m in summary.items() if "tf_agreement" in m}
    if not forced:
        return []
    cells = []
    for name, m in forced.items():
        lo, hi = m["tf_agreement_ci95"]
        delta = m.get("tf_agreement_delta")
        shown = (f"{delta['mean']:+.3f} ({delta['ci95'][0]:+.3f} to {delta['ci95'][1]:+.3f}) vs {delta['vs']}"
                 if delta else "baseline" if any(d.get("tf_agreement_delta", {}).get("vs") == name
                                                  for d in forced.values()) else "-")
        cells.append([name, f"{m['tf_agreement']:.3f} ({lo:.2f}-{hi:.2f})", f"{m['tf_kl']:.4f}", shown])
    return ["", "Teacher-forced along full prefill's answer (each policy's next token at every answer "
            "position; Δ is paired per question):", "",
            *table_lines(["policy", "TF top-1 agreement (95% CI)", "mean KL vs full", "Δ agreement (95% CI)"],
                         cells)]


def gate_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    gates = {name: m["gate"] for name, m in summary.items() if "gate" in m}
    if not gates:
        return []
    cells = [[name, f"{g['escalated_share']:.2f} of {g['questions']}", _or_dash(g["margin_median"]),
              _or_dash(g["computed_escalated"]), _or_dash(g["computed_confident"])] for name, g in gates.items()]
    return ["", "Gate decisions (escalated: reuse's first-token margin below the threshold, the budget "
            "spent; the computed column above is the mean over all questions):", "",
            *table_lines(["policy", "escalated", "median margin", "computed where escalated",
                          "computed where confident"], cells)]


def _or_dash(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def shown_layers(num_layers: int) -> list[int]:
    """Every layer of a shallow model; of a deep one the first four, every fourth, and the last."""
    if num_layers <= 12:
        return list(range(num_layers))
    return sorted({0, 1, 2, 3, *range(3, num_layers, 4), num_layers - 1})


def divergence_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    diverged = {name: m["divergence"] for name, m in summary.items() if "divergence" in m}
    if not diverged:
        return []
    layers = shown_layers(len(next(iter(diverged.values()))["relative_l2"]))
    cells = [[name, *(f"{d['relative_l2'][layer]:.3f} ({d['cosine_distance'][layer]:.3f})" for layer in layers)]
             for name, d in diverged.items()]
    lines = ["", "Per-layer divergence of the last prompt token's hidden state from full prefill's (mean over "
             "questions; relative L2 |h - h_full| / |h_full|, cosine distance in brackets):", "",
             *table_lines(["policy", *(f"layer {layer}" for layer in layers)], cells)]
    heads = {name: m["oracle_head_share"] for name, m in summary.items() if "oracle_head_share" in m}
    for name, share in heads.items():
        lines.append("")
        lines.append(f"{name}: {share:.2f} of its picks sit in the first 16 tokens of their chunk")
    return lines


def merge_partials(paths: list[Path], out: Path | None = None, baseline: str = BASELINE,
                   drop: tuple[str, ...] = (), k: int = 4, max_tokens: int = 32) -> str:
    """One table from the rows of several runs (their <json>.partial.jsonl files, or their JSON
    reports), e.g. a run the --max-minutes cap stopped and a second one on the records after it:
    the policies every row holds (minus `drop`), summarized as `bench fidelity` does (paired
    bootstrap, fixed seed). Rows measured with generation and without (--no-generate) mix: ROUGE-L,
    EM and F1 then cover the generated rows only, so their text is dropped unless all have it."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        text = Path(path).read_text(encoding="utf-8")
        if Path(path).suffix == ".json":
            rows += json.loads(text)["rows"]
        else:
            rows += [json.loads(line) for line in text.splitlines() if line.strip()]
    if not rows:
        raise InvalidPromptError("no rows in " + ", ".join(str(p) for p in paths))
    policies = [p for p in rows[0]["policies"] if p not in drop and all(p in r["policies"] for r in rows)]
    generated = all(r["policies"][p].get("text") is not None for r in rows for p in policies)
    if not generated:
        for r in rows:
            for p in policies:
                if p != "full":
                    r["policies"][p]["text"] = None
    summary = policy_summary(rows, policies, baseline)
    config = {"n": len(rows), "k": k, "max_tokens": max_tokens, "model": "(merged runs)",
              "merged_from": [str(p) for p in paths], "generated": generated, "policies": policies}
    table = fidelity_table(summary, config)
    if out is not None:
        write_report(out, {"config": config, "policies": summary, "rows": rows}, table)
    return table


if __name__ == "__main__":  # python -m ragcache_lab.fidelity OUT.json IN.partial.jsonl ... [--drop P,Q]
    import sys

    cli = argparse.ArgumentParser(description="merge bench fidelity rows of several runs into one table")
    cli.add_argument("out", type=Path)
    cli.add_argument("inputs", type=Path, nargs="+")
    cli.add_argument("--baseline", default=BASELINE)
    cli.add_argument("--drop", default="", help="comma list of policies to leave out")
    cli.add_argument("--k", type=int, default=4, help="chunks per question of the runs (for the title)")
    cli.add_argument("--max-tokens", type=int, default=32, help="answer tokens of the runs (for the title)")
    ns = cli.parse_args(sys.argv[1:])
    print(merge_partials(ns.inputs, ns.out, ns.baseline, tuple(p for p in ns.drop.split(",") if p), ns.k,
                         ns.max_tokens))
