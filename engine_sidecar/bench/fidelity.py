"""`ragcache bench fidelity`: answer quality and TTFT of each policy against full prefill.

Policies run interleaved per question (these machines are shared and noisy, so only ratios
measured side by side mean anything). All chunks are warmed first, so every policy but `full`
sees 100% chunk hits. transformers' own prefill of the same token ids is timed too, to show the
engine's `full` is an honest baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import track

from engine_sidecar.bench.datasets import chunk_texts
from engine_sidecar.bench.metrics import bootstrap_ci, exact_match, rouge_l, token_f1
from engine_sidecar.bench.report import write_report
from engine_sidecar.errors import InvalidPromptError
from ragcache_integrations.types import ChunkedPrompt, SamplingParams


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


def prepare_chunks(engine: Any, record: dict[str, Any], k: int, policies: list[str],
                   chunk_kv: str = "precomputed") -> None:
    # warmed per question (not all up front) so a RAM tier smaller than the whole set cannot
    # turn a policy's lookups into misses
    if chunk_kv == "in-context":
        # misses computed in place by a request with the chunks in another order: the KV a live
        # stream leaves behind (the question then reuses it in its own order, fused)
        engine.generate(ChunkedPrompt(chunks=rotated(chunk_texts(record, k)), question=record["question"]),
                        {"max_tokens": 1}, policy="cacheblend")
    else:
        engine.warm(chunk_texts(record, k))
    if any(p.startswith("cachecraft") for p in policies):
        # Cache-Craft keeps KV computed inside requests: a request with these chunks in another
        # order records the variants the measured question then reuses
        engine.generate(ChunkedPrompt(chunks=rotated(chunk_texts(record, k)), question=record["question"]),
                        {"max_tokens": 1}, policy="cachecraft")


def run_fidelity(args: argparse.Namespace) -> int:
    from engine_sidecar.bench.datasets import load_dataset
    from engine_sidecar.engine_args import engine_from_args

    console = Console()
    records = load_dataset(args.data)[: args.n]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "full" not in policies:
        policies.insert(0, "full")
    sampling = SamplingParams(max_tokens=args.max_tokens)
    # Each question is asked once per policy: a CP-Tree would turn later policies' chunks into
    # exact prefix hits and blur what each fusion policy does on its own.
    args.no_prefix_tree = True
    rows: list[dict[str, Any]] = []
    with engine_from_args(args) as engine:
        hf_model = None
        if not args.no_transformers:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.runner.dtype).eval()
        # first-request costs off the clock, on text outside the data set: a passage of the set
        # would be stored in place here and reused exactly by its question
        engine.generate(ChunkedPrompt(chunks=["A warm-up passage, not part of any record."], question="warm-up"),
                        {"max_tokens": 2}, policy="full")
        for i, record in enumerate(track(records, description="answering", console=console)):
            follow = records[i + 1] if args.follow_up and i + 1 < len(records) else None
            if args.follow_up and follow is None:
                break  # the last record has no next question to follow up with
            for rec in (record, follow) if follow is not None else (record,):
                prepare_chunks(engine, rec, args.k, policies, getattr(args, "chunk_kv", "precomputed"))
            prompt = ChunkedPrompt(chunks=chunk_texts(record, args.k), question=record["question"])
            measured = follow or record
            row: dict[str, Any] = {"index": i, "question": measured["question"],
                                   "answers": measured.get("answers", []), "policies": {}}
            for policy in policies:
                if follow is None:
                    result = engine.generate(prompt, sampling, policy=policy)
                else:
                    # a two-turn conversation under this policy; turn 2 (the next record's
                    # question over its own passages) is measured
                    conversation = f"fidelity-{i}-{policy}"
                    engine.generate(prompt.model_copy(update={"conversation_id": conversation}), sampling,
                                    policy=policy)
                    result = engine.generate(ChunkedPrompt(chunks=chunk_texts(follow, args.k),
                                                           question=follow["question"], conversation_id=conversation),
                                             sampling, policy=policy)
                row["policies"][policy] = {"text": result.text, "first_token": result.token_ids[:1],
                                           "token_ids": result.token_ids,
                                           "ttft_s": result.stats.ttft_s,
                                           "computed_fraction": result.stats.computed_fraction,
                                           "recompute_share": result.stats.tokens_recomputed / max(
                                               1, result.stats.tokens_recomputed + result.stats.tokens_reused),
                                           "prompt_tokens": result.stats.prefill_tokens_total}
            if follow is None and not getattr(args, "no_teacher_forced", False):
                teacher_forced(engine, prompt, row, policies)
            if hf_model is not None and follow is None:
                ids = engine.builder.build(prompt).token_ids
                row["transformers_prefill_s"] = _transformers_prefill_s(hf_model, ids)
            rows.append(row)
    summary = summarize(rows, policies, getattr(args, "baseline", "cacheblend:0.15"))
    if not rows:
        raise InvalidPromptError("--follow-up needs at least two questions (--n 2 or more)")
    config = {"data": str(args.data), "n": len(rows), "k": args.k, "max_tokens": args.max_tokens,
              "follow_up": bool(args.follow_up),
              "model": str(args.model), "dtype": args.dtype, "device": args.device, "policies": policies,
              "convention": args.convention, "chunk_kv": getattr(args, "chunk_kv", "precomputed")}
    transformers_times = [r["transformers_prefill_s"] for r in rows if "transformers_prefill_s" in r]
    if transformers_times:
        config["transformers_prefill_median_s"] = statistics.median(transformers_times)
    table = markdown_table(summary, config)
    print(table)
    if args.json:
        written = write_report(args.json, {"config": config, "policies": summary, "rows": rows}, table)
        plot = scatter_plot(summary, config, args.json.with_suffix(".png"))
        console.print("wrote " + ", ".join(str(p) for p in [*written, *([plot] if plot else [])]))
    return 0


def teacher_forced(engine: Any, prompt: ChunkedPrompt, row: dict[str, Any], policies: list[str]) -> None:
    """Each policy's next-token distributions along full prefill's own answer (fed back token by
    token): top-1 agreement with full's and mean KL(full || policy) per answer position."""
    answer = row["policies"]["full"]["token_ids"]
    if not answer:
        return
    reference = engine.teacher_forced_logits(prompt, answer[:-1], policy="full")[0].float().log_softmax(-1)
    for policy in policies:
        logprobs = reference if policy == "full" else (
            engine.teacher_forced_logits(prompt, answer[:-1], policy=policy)[0].float().log_softmax(-1))
        agreement = (logprobs.argmax(-1) == reference.argmax(-1)).float().mean()
        kl = (reference.exp() * (reference - logprobs)).sum(-1).mean()
        row["policies"][policy]["tf_agreement"] = float(agreement)
        row["policies"][policy]["tf_kl"] = float(kl)


def scatter_plot(summary: dict[str, dict[str, float]], config: dict[str, Any], path: Path) -> Path | None:
    """Quality (ROUGE-L vs full) against TTFT (vs full), one labelled point per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is not installed: the table and JSON still stand
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for i, (name, m) in enumerate(summary.items()):
        ax.scatter(m["ttft_ratio_vs_full"], m["rouge_l_vs_full"], s=36)
        share = "all computed" if name == "full" else f"{m['recompute_share']:.2f}"
        # alternate label sides so neighbouring points stay readable
        ax.annotate(f"{name} ({share})", (m["ttft_ratio_vs_full"], m["rouge_l_vs_full"]),
                    textcoords="offset points", xytext=(6, 4) if i % 2 else (6, -11), fontsize=8)
    ax.set_xlabel("TTFT / full prefill TTFT (median, lower is faster)")
    ax.set_ylabel("ROUGE-L of the answer vs full prefill's")
    turn = ", turn 2 of conversations" if config.get("follow_up") else ""
    ax.set_title(f"{Path(str(config['data'])).stem}: {config['n']} questions, k={config['k']}{turn} "
                 "(recompute share in brackets)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def summarize(rows: list[dict[str, Any]], policies: list[str],
              baseline: str = "cacheblend:0.15") -> dict[str, dict[str, Any]]:
    full_ttft = statistics.median(r["policies"]["full"]["ttft_s"] for r in rows)
    out: dict[str, dict[str, Any]] = {}
    base = baseline if baseline in policies else "reuse" if "reuse" in policies else None
    forced = [r for r in rows if all("tf_agreement" in r["policies"][p] for p in policies)]
    for policy in policies:
        per = [(r, r["policies"][policy]) for r in rows]
        ttft = statistics.median(p["ttft_s"] for _, p in per)
        rouge = [rouge_l(p["text"], r["policies"]["full"]["text"]) for r, p in per]
        rouge_lo, rouge_hi = bootstrap_ci(rouge)
        out[policy] = {
            "em": statistics.mean(exact_match(p["text"], r["answers"]) for r, p in per),
            "f1": statistics.mean(token_f1(p["text"], r["answers"]) for r, p in per),
            "rouge_l_vs_full": statistics.mean(rouge),
            "rouge_l_ci95": [rouge_lo, rouge_hi],
            "first_token_agreement": statistics.mean(
                float(p["first_token"] == r["policies"]["full"]["first_token"]) for r, p in per),
            "ttft_median_s": ttft,
            "ttft_ratio_vs_full": ttft / full_ttft,
            "computed_fraction": statistics.mean(p["computed_fraction"] for _, p in per),
            "recompute_share": statistics.mean(p.get("recompute_share", 0.0) for _, p in per),
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
    return out


def markdown_table(summary: dict[str, dict[str, float]], config: dict[str, Any]) -> str:
    turn = "; turn 2 of a two-turn conversation (the next record's question)" if config.get("follow_up") else ""
    lines = [
        f"fidelity: {config['n']} questions, {config['k']} chunks each, {config['max_tokens']} tokens, "
        f"model {config['model']}, chunk KV {config.get('chunk_kv', 'precomputed')}{turn}",
        "",
        "| policy | EM | F1 | ROUGE-L vs full (95% CI) | first-token agreement | TTFT median (s) | TTFT vs full "
        "| computed | recompute share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in summary.items():
        lo, hi = m.get("rouge_l_ci95", (m["rouge_l_vs_full"], m["rouge_l_vs_full"]))
        lines.append(f"| {name} | {m['em']:.2f} | {m['f1']:.3f} | {m['rouge_l_vs_full']:.3f} ({lo:.2f}-{hi:.2f}) | "
                     f"{m['first_token_agreement']:.2f} | {m['ttft_median_s']:.3f} | {m['ttft_ratio_vs_full']:.3f} | "
                     f"{m['computed_fraction']:.3f} | {m['recompute_share']:.3f} |")
    forced = {name: m for name, m in summary.items() if "tf_agreement" in m}
    if forced:
        lines += ["", "Teacher-forced along full prefill's answer (each policy's next token at every answer "
                  "position; Δ is paired per question):", "",
                  "| policy | TF top-1 agreement (95% CI) | mean KL vs full | Δ agreement (95% CI) |",
                  "|---|---|---|---|"]
        for name, m in forced.items():
            lo, hi = m["tf_agreement_ci95"]
            delta = m.get("tf_agreement_delta")
            shown = (f"{delta['mean']:+.3f} ({delta['ci95'][0]:+.3f} to {delta['ci95'][1]:+.3f}) vs {delta['vs']}"
                     if delta else "baseline" if any(d.get("tf_agreement_delta", {}).get("vs") == name
                                                      for d in forced.values()) else "-")
            lines.append(f"| {name} | {m['tf_agreement']:.3f} ({lo:.2f}-{hi:.2f}) | {m['tf_kl']:.4f} | {shown} |")
    if "transformers_prefill_median_s" in config:
        lines.append("")
        lines.append(f"transformers' own prefill of the same prompts: median "
                     f"{config['transformers_prefill_median_s']:.3f} s; engine `full` TTFT median "
                     f"{summary['full']['ttft_median_s']:.3f} s (ratio "
                     f"{summary['full']['ttft_median_s'] / config['transformers_prefill_median_s']:.2f})")
    return "\n".join(lines)
