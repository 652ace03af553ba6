"""`ragcache check --model DIR`: the guards that make a model folder safe to serve with chunk reuse,
and a short fidelity probe, in a table and JSON, ending with one verdict line.

Guards (a failed one makes the exit code 1):
- full prefill equals transformers on the same tokens (largest logit difference; the same greedy
  tokens over 16 steps where transformers' choice is clear of its dtype's rounding);
- CacheBlend at ratio 1.0 equals full prefill (chunks stored from one prefill, placed in another
  order: every token recomputed through every window and RoPE table);
- a chunk's stored (pre-RoPE) keys rotated to a new position equal the keys computed there;
- the GPU kernels (Triton) equal the torch reference, where a GPU is present.

The probe asks the bundled passages' questions under full prefill, `reuse` and the default policy:
first-token and teacher-forced agreement with full prefill, ROUGE-L of the free-running answers.
It measures faithfulness to full prefill, not the model's accuracy."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine_sidecar.cli.check_passages import PASSAGES, QUESTIONS

TOKENS = 16  # greedy steps compared with transformers, and teacher-forced in the probe


@dataclass
class Guard:
    name: str
    passed: bool | None  # None: not applicable here (skipped)
    measured: str
    limit: str


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 0.25


def guard_transformers(runner: Any, model_dir: Path, ids: torch.Tensor) -> Guard:
    """Full prefill and greedy decode against transformers in the runner's dtype."""
    from transformers import AutoModelForCausalLM

    from engine_sidecar.execution.batched_decode import decode_step
    from engine_sidecar.execution.fused_prefill import fused_prefill
    from engine_sidecar.execution.plan import FusionPlan, PlanSpan
    from engine_sidecar.execution.policies import FullPolicy

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=runner.dtype).eval()
    with torch.inference_mode():
        answer = reference.generate(ids[None], max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0]
        theirs = reference(answer[None]).logits[0, len(ids) - 1 : -1].float()
    del reference
    plan = FusionPlan([PlanSpan("question", 0, tuple(ids.tolist()), "fresh")], "full")
    result = fused_prefill(runner, plan, FullPolicy(), capacity=len(ids) + TOKENS)
    mine = [result.logits]
    for token in answer[len(ids) : -1].tolist():
        mine.append(decode_step(runner, result.kv, token))
    ours = torch.stack(mine).float()
    diff = float((ours - theirs).abs().max())
    top2 = theirs.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff  # a choice closer than the two outputs differ is a toss-up
    same = int((ours.argmax(-1) == answer[len(ids) :])[clear].sum())
    tol = _tolerance(runner.dtype)
    return Guard("full prefill == transformers", diff <= tol and same == int(clear.sum()),
                 f"max abs logit diff {diff:.2e}; greedy tokens {same}/{int(clear.sum())} of the clear steps "
                 f"({TOKENS} steps)", f"<= {tol:g}, all clear steps equal")


def guard_ratio_one(runner: Any, ids: tuple[int, ...]) -> Guard:
    from engine_sidecar.execution import kernel_warmup
    from engine_sidecar.execution.fused_prefill import fused_prefill
    from engine_sidecar.execution.plan import FusionPlan, PlanSpan
    from engine_sidecar.execution.policies import CacheBlendPolicy, FullPolicy

    plan = kernel_warmup.fused_plan(ids, kernel_warmup.full_kv(runner, ids))
    full_plan = FusionPlan([PlanSpan("question", 0, tuple(plan.token_ids), "fresh")], "full")
    full = fused_prefill(runner, full_plan, FullPolicy()).logits
    one = fused_prefill(runner, plan, CacheBlendPolicy(1.0)).logits
    diff = float((one - full).abs().max())
    tol = 1e-4 if runner.dtype == torch.float32 else _tolerance(runner.dtype)
    return Guard("cacheblend:1.0 == full", diff <= tol, f"max abs logit diff {diff:.2e}", f"<= {tol:g}")


def guard_rotation(runner: Any, ids: tuple[int, ...]) -> Guard:
    """Layer 0 (whose keys depend on the token alone): a chunk computed at position 0, its stored
    keys rotated to offset d, against the same chunk computed at d after other tokens."""
    from engine_sidecar.execution import kernel_warmup

    chunk, offset = ids[:24], 57
    alone = kernel_warmup.full_kv(runner, chunk)
    after = kernel_warmup.full_kv(runner, ids[24 : 24 + offset] + chunk)
    worst = 0.0
    positions = torch.arange(offset, offset + len(chunk), device=runner.device)
    placed = runner.rope(alone.keys_pre[0, : len(chunk)], positions, 0)
    worst = float((placed - after.keys[0, offset : offset + len(chunk)]).abs().max())
    tol = 1e-4 if runner.dtype == torch.float32 else 5e-2
    return Guard("stored chunk rotated == computed at its position", worst <= tol,
                 f"max abs key diff {worst:.2e} (layer 0, offset {offset})", f"<= {tol:g}")


def guard_kernels(runner: Any) -> Guard:
    if runner.device.type != "cuda":
        return Guard("Triton kernels == torch reference", None, "no GPU here: skipped", "")
    from engine_sidecar.execution import kernel_warmup
    from engine_sidecar.execution.fused_prefill import fused_prefill
    from engine_sidecar.execution.policies import CacheBlendPolicy

    ids = kernel_warmup.made_up_ids(256, runner.config.vocab_size, 5)
    plan = kernel_warmup.fused_plan(ids, kernel_warmup.full_kv(runner, ids))
    import os

    triton = fused_prefill(runner, plan, CacheBlendPolicy(0.15)).logits
    previous = os.environ.get("RAGCACHE_KERNELS")
    os.environ["RAGCACHE_KERNELS"] = "torch"
    try:
        torch_ref = fused_prefill(runner, plan, CacheBlendPolicy(0.15)).logits
    finally:
        if previous is None:
            os.environ.pop("RAGCACHE_KERNELS", None)
        else:
            os.environ["RAGCACHE_KERNELS"] = previous
    diff = float((triton - torch_ref).abs().max())
    return Guard("Triton kernels == torch reference", diff <= 0.25, f"max abs logit diff {diff:.2e}", "<= 0.25")


def fidelity_probe(engine: Any, policies: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per policy: first-token and teacher-forced agreement with full prefill, and ROUGE-L of its
    free-running answer against full prefill's, averaged over the bundled questions."""
    from engine_sidecar.calibrate.metrics import rouge_l
    from ragcache_integrations.types import ChunkedPrompt, SamplingParams

    engine.warm(PASSAGES)
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    scores: dict[str, dict[str, list[float]]] = {p: {"first_token": [], "teacher_forced": [], "rouge_l": []}
                                                 for p in policies}
    for i, question in enumerate(QUESTIONS):
        chunks = [PASSAGES[(i + k) % len(PASSAGES)] for k in range(3)][::-1]  # other order than warmed
        prompt = ChunkedPrompt(chunks=chunks, question=question)
        full = engine.generate(prompt, sampling, policy="full")
        # full prefill's greedy answer is its own teacher-forced argmax, token for token
        answer = torch.tensor(full.token_ids)
        for policy in policies:
            tf, _ = engine.teacher_forced_logits(prompt, answer.tolist(), policy=policy)
            agree = (tf.argmax(-1)[: len(answer)].cpu() == answer).float()
            scores[policy]["first_token"].append(float(agree[0]))
            scores[policy]["teacher_forced"].append(float(agree.mean()))
            scores[policy]["rouge_l"].append(rouge_l(engine.generate(prompt, sampling, policy=policy).text,
                                                     full.text))
    return {p: {k: round(sum(v) / len(v), 3) for k, v in s.items()} for p, s in scores.items()}


def run_check(model: str, device: str, dtype: str, json_out: Path | None, probe: bool) -> int:
    from engine_sidecar import Engine
    from engine_sidecar.execution import kernel_warmup
    from engine_sidecar.model.prepare import resolve_model_dir
    from ragcache_integrations.policy_registry import DEFAULT_POLICY

    started = time.perf_counter()
    model_dir = resolve_model_dir(model)
    engine = Engine.from_pretrained(model_dir, device=device, dtype=dtype, disk=False, prefix_tree=False)
    with engine:
        runner = engine.model_runner()
        c = runner.config
        # the passages' own tokens (a random model's vocabulary may be smaller than its tokenizer's)
        ids = torch.tensor([t % c.vocab_size for t in engine.encode(" ".join(PASSAGES))[:96]])
        if len(ids) < 96:
            ids = torch.tensor(kernel_warmup.made_up_ids(96, c.vocab_size, 1))
        guards = [guard_transformers(runner, model_dir, ids), guard_ratio_one(runner, tuple(ids.tolist())),
                  guard_rotation(runner, tuple(ids.tolist())), guard_kernels(runner)]
        fidelity = fidelity_probe(engine, ("reuse", DEFAULT_POLICY)) if probe else {}
    failed = [g.name for g in guards if g.passed is False]
    report = {"model": str(model_dir), "model_type": c.model_type, "layers": c.num_layers,
              "dtype": str(runner.dtype).removeprefix("torch."), "device": str(runner.device),
              "guards": [asdict(g) for g in guards], "fidelity_vs_full": fidelity,
              "seconds": round(time.perf_counter() - started, 1), "passed": not failed}
    _print(report, guards, fidelity)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
    verdict = "PASS" if not failed else "FAIL (" + "; ".join(failed) + ")"
    print(f"\nverdict: {verdict}: {c.model_type} {report['dtype']} on {report['device']} "
          f"in {report['seconds']} s")
    return 0 if not failed else 1


def _print(report: dict[str, Any], guards: list[Guard], fidelity: dict[str, dict[str, float]]) -> None:
    print(f"ragcache check: {report['model']} ({report['model_type']}, {report['layers']} layers, "
          f"{report['dtype']}, {report['device']})\n")
    print("| guard | result | measured | limit |\n|---|---|---|---|")
    for g in guards:
        result = "skipped" if g.passed is None else ("pass" if g.passed else "FAIL")
        print(f"| {g.name} | {result} | {g.measured} | {g.limit} |")
    if fidelity:
        print(f"\nfidelity vs full prefill ({len(QUESTIONS)} questions over bundled passages, warmed in another "
              "order):\n")
        print("| policy | first token | teacher-forced | ROUGE-L |\n|---|---|---|---|")
        for policy, s in fidelity.items():
            print(f"| {policy} | {s['first_token']:.2f} | {s['teacher_forced']:.3f} | {s['rouge_l']:.3f} |")
