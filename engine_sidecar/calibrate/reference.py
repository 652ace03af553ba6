"""Full prefill as the reference a reused-KV policy is measured against: one prefill on the
engine's runner (nothing cached or read) that yields full's greedy answer, the teacher-forced
reference logits along it, the last prompt token's hidden state per layer and the prompt's KV.
`ragcache calibrate-temperature` follows that answer; the benchmarks compare against all of it.

The per-layer hidden state of the last prompt token is read at the model runner, not inside the
executor: for the duration of one prefill, `capture_last_hidden` wraps the runner's `mlp` (whose
output is the residual stream after a layer) and keeps the last row of each layer's output, which
is always the last prompt token (the executor keeps it active on every layer: it produces the
logits). Only calls from the capturing thread count, so a background precompute cannot mix in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from engine_sidecar.execution.batched_decode import decode_step
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import FullPolicy

if TYPE_CHECKING:
    from ragcache_integrations.types import ChunkedPrompt


@contextmanager
def capture_last_hidden(runner: Any, stamps: list[float] | None = None) -> Iterator[list[torch.Tensor]]:
    """Within the block, every `runner.mlp` call of this thread appends the last row of its
    output (fp32, on the CPU), and its end time to `stamps`. The first `num_layers` entries are a prefill's last prompt token
    after layers 0..L-1; decode steps (teacher forcing) append after them."""
    rows: list[torch.Tensor] = []
    stamps = stamps if stamps is not None else []
    original = runner.mlp
    thread = threading.get_ident()

    def mlp(layer: int, hidden: torch.Tensor) -> torch.Tensor:
        out = original(layer, hidden)
        if threading.get_ident() == thread:
            rows.append(out[-1].detach().float().cpu().clone())
            stamps.append(time.perf_counter())
        return out

    runner.mlp = mlp
    try:
        yield rows
    finally:
        del runner.mlp  # the instance attribute shadowed the class's method


def prefill_hidden(rows: list[torch.Tensor], num_layers: int) -> torch.Tensor:
    """[L, hidden] from a capture whose first call was a prefill."""
    if len(rows) < num_layers:
        raise AssertionError(f"captured {len(rows)} layer outputs, expected at least {num_layers}")
    return torch.stack(rows[:num_layers])


def full_pass(runner: Any, token_ids: list[int], max_tokens: int, stop_ids: set[int],
              follow: list[int] | None = None) -> dict[str, Any]:
    """Full prefill of `token_ids` on `runner`, then greedy decoding as the engine does (stop
    tokens end it, none is kept), all with no cache read or written. One prefill gives full's
    answer, the logits along it (row i: after the prompt and the answer's first i tokens: the
    teacher-forced reference), the last prompt token's hidden state per layer and the prompt's KV
    (for the oracle). With `follow`, the same prefill is then fed `follow` instead (the KV is
    rewound to the prompt), for logits along another answer (the noise floor's other dtype)."""
    n = len(token_ids)
    capacity = n + max(max_tokens, len(follow or [])) + 1
    plan = FusionPlan([PlanSpan("question", 0, tuple(token_ids), "fresh")], "full")
    with capture_last_hidden(runner) as rows:
        started = time.perf_counter()
        result = fused_prefill(runner, plan, FullPolicy(), capacity=capacity)
        ttft = time.perf_counter() - started
        hidden = prefill_hidden(rows, runner.num_layers)
    kv = result.kv
    assert result.logits is not None
    logits = [result.logits.float()]
    generated: list[int] = []
    while True:
        token = int(torch.argmax(logits[-1]))
        if token in stop_ids:
            break
        generated.append(token)
        if len(generated) >= max_tokens:
            break
        logits.append(decode_step(runner, kv, token).float())
    out: dict[str, Any] = {"token_ids": generated, "logits": torch.stack(logits[: max(1, len(generated))]),
                           "hidden": hidden, "ttft_s": ttft, "keys_pre": kv.keys_pre[:, :n],
                           "values": kv.values[:, :n]}
    if follow is not None:
        kv.length = n  # rewind: decode overwrites the answer's rows
        forced = [result.logits.float()] + [decode_step(runner, kv, t).float() for t in follow]
        out["follow_logits"] = torch.stack(forced)
    return out


def full_reference(engine: Any, prompt: ChunkedPrompt, max_tokens: int) -> dict[str, Any]:
    """Full prefill of the prompt as the engine assembles it, on the engine's runner (the same
    executor and decode as `engine.generate(policy='full')`, nothing cached or read), greedy:
    full's row of the table, plus the reference logits, hidden states and KV."""
    ids = engine.prompt_token_ids(prompt)
    ref = full_pass(engine.model_runner(), ids, max_tokens, engine.eos_ids)
    ref["row"] = {"text": engine.decode(ref["token_ids"]), "first_token": ref["token_ids"][:1],
                  "token_ids": ref["token_ids"], "ttft_s": ref["ttft_s"], "computed_fraction": 1.0,
                  "recompute_share": 0.0, "prompt_tokens": len(ids)}
    return ref
