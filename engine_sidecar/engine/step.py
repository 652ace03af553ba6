"""The one path a prompt's KV takes through the engine: plan, prefill, check, commit.

The scheduler's requests, the fidelity probes and a prefill shared with vLLM all go through here,
so each gets the same store reads (lazy disk reads prefetched layer by layer), the same retry on
a damaged file, the same cost learning and RAM promotion, and the same rule for keeping what was
computed: only after a prefill that succeeded, with finite logits. A request commits after its
first token is out (`commit` with the check already done by the token's choice); everything else
commits right after its prefill (`run`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_sidecar.engine.prefill_stage import PrefillStage
from engine_sidecar.errors import NON_FINITE_MESSAGE, NonFiniteLogitsError
from engine_sidecar.execution.fused_prefill import PrefillResult
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.policies import Policy
from engine_sidecar.reuse.commit import ReuseWriter
from engine_sidecar.reuse.plan_stage import PlanStage
from engine_sidecar.reuse.planner import PlannedRequest
from ragcache_integrations.types import ChunkedPrompt


class PrefillStep:
    def __init__(self, planning: PlanStage, prefill: PrefillStage, writer: ReuseWriter):
        self.planning, self.prefill_stage, self.writer = planning, prefill, writer

    def plan(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, lazy: bool = True) -> PlannedRequest:
        return self.planning.plan(prompt, policy, tenant, lazy=lazy)

    def plan_to_fit(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, max_tokens: int,
                    max_context: int) -> PlannedRequest:
        return self.planning.plan_to_fit(prompt, policy, tenant, max_tokens, max_context)

    def prefill(self, planned: PlannedRequest, policy: Policy, prompt: ChunkedPrompt | None, tenant: str,
                capacity: int, times: dict[str, float], upto: int | None = None,
                allocate: Callable[[int], KVBuffer] | None = None) -> tuple[PlannedRequest, PrefillResult]:
        """Run the plan (only the spans that start before `upto`, without logits, when given). A
        file found damaged mid-read is planned again with whole-file reads. `allocate(rows)` makes
        the KV buffer (default: a new one)."""
        replan = (lambda: self.planning.plan(prompt, policy, tenant, lazy=False)) if prompt is not None else None
        return self.prefill_stage.run(planned, policy, capacity, times, replan, upto, allocate)

    def commit(self, planned: PlannedRequest, result: PrefillResult, tenant: str, check_logits: bool = True) -> None:
        """Keep what the prefill computed. NaN or infinity anywhere in the KV reaches the last
        token's logits (every query attends to every earlier key), so finite logits clear the
        whole prefill; a caller that already read that check (the first token's choice, in the
        same host sync) passes check_logits=False."""
        if check_logits and result.logits is not None and not bool(torch.isfinite(result.logits.max())):
            raise NonFiniteLogitsError(NON_FINITE_MESSAGE)
        self.writer.commit(planned, result, tenant)

    def run(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, extra_capacity: int,
            times: dict[str, float], allocate: Callable[[int], KVBuffer] | None = None,
            ) -> tuple[PlannedRequest, PrefillResult]:
        """Plan, prefill with room for `extra_capacity` more tokens, check, commit."""
        planned = self.plan(prompt, policy, tenant)
        planned, result = self.prefill(planned, policy, prompt, tenant, planned.plan.num_tokens + extra_capacity,
                                       times, allocate=allocate)
        self.commit(planned, result, tenant)
        return planned, result
