"""Fidelity probes: a policy's logits along a given continuation, and what an ordinary full
prefill costs now. They run under the engine lock between scheduler steps, outside any
Sequence, so the benchmarks can compare policies token for token without sampling."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from engine_sidecar.engine.prefill_stage import PrefillStage
from engine_sidecar.engine.request_prep import RequestPreparer
from engine_sidecar.engine.stats import request_stats
from engine_sidecar.execution.batched_decode import decode_step
from engine_sidecar.execution.fused_prefill import PrefillResult, fused_prefill
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.kv_pool import KVPool
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import Policy, parse_policy
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.request.prompt import PromptBuilder
from engine_sidecar.reuse.cache import ReuseCache
from engine_sidecar.reuse.planner import PlannedRequest
from ragcache_integrations.policy_registry import DEFAULT_POLICY
from ragcache_integrations.types import ChunkedPrompt, GenerationStats


class FidelityProbes:
    def __init__(self, runner: ModelRunner, builder: PromptBuilder, prep: RequestPreparer, lock: threading.RLock,
                 cache: ReuseCache, prefill: PrefillStage, convention: str, kv_pool: KVPool | None = None):
        self.runner, self.builder, self.prep, self.cache, self.prefill = runner, builder, prep, cache, prefill
        self._lock = lock  # the engine's
        self.convention = convention
        # KV buffers as the scheduler's requests get them, so a probe's time is theirs
        self.kv_pool = kv_pool
        self._allocate = kv_pool.take if kv_pool is not None else None

    def prefill_logits(self, prompt: ChunkedPrompt | dict, policy: str | Policy = DEFAULT_POLICY,
                       tenant: str = "", order: str = "preserve") -> tuple[torch.Tensor, GenerationStats]:
        """Next-token logits after the prompt, and the prefill's stats (for fidelity checks)."""
        logits, stats = self.teacher_forced_logits(prompt, [], policy, tenant, order)
        return logits[0], stats

    def teacher_forced_logits(self, prompt: ChunkedPrompt | dict, continuation: list[int],
                              policy: str | Policy = DEFAULT_POLICY, tenant: str = "",
                              order: str = "preserve") -> tuple[torch.Tensor, GenerationStats]:
        """Logits [1 + len(continuation), vocab]: after the prompt, then after each token of
        `continuation` fed back in turn (teacher forcing). Along full prefill's own answer this
        compares a policy's next-token choices step by step, without free-running divergence."""
        prompt, _, pol = self.prep.prepare(prompt, None, policy, order, tenant)
        t0 = time.perf_counter()
        self.prep.validate(prompt, len(continuation) + 1)
        with self._lock:
            planned, result = self._run(prompt, pol, tenant, len(continuation) + 1, self._allocate)
            assert result.logits is not None
            rows = [result.logits]
            rows += [decode_step(self.runner, result.kv, token) for token in continuation]
            self._give_back(result)
        stats = request_stats(planned, result, time.perf_counter() - t0, {}, self.runner.num_layers,
                              self.convention)
        return torch.stack(rows), stats

    def prefill_kv(self, prompt: ChunkedPrompt | dict, policy: str | Policy = DEFAULT_POLICY, tenant: str = "",
                   order: str = "preserve") -> tuple[tuple[int, ...], PrefillResult, GenerationStats]:
        """The prompt's token ids and KV as the engine's prefill leaves them (the policy's fusion,
        store reads, misses computed in place and committed), for a backend that decodes
        elsewhere: the vLLM connector writes this KV into vLLM's paged cache."""
        prompt, _, pol = self.prep.prepare(prompt, None, policy, order, tenant)
        t0 = time.perf_counter()
        self.prep.validate(prompt, 1)
        with self._lock:
            planned, result = self._run(prompt, pol, tenant, 0)
        stats = request_stats(planned, result, time.perf_counter() - t0, {}, self.runner.num_layers,
                              self.convention)
        return tuple(planned.plan.token_ids), result, stats

    def measure_full_prefill(self, prompt: ChunkedPrompt | dict) -> float:
        """Seconds an ordinary full prefill of this prompt takes now, without touching the cache,
        the CA-Table or conversations: the baseline a reuse figure is compared with."""
        prompt = prompt if isinstance(prompt, ChunkedPrompt) else ChunkedPrompt.model_validate(prompt)
        ids = tuple(self.builder.build(prompt).token_ids)
        with self._lock:
            start = time.perf_counter()
            result = fused_prefill(self.runner, FusionPlan([PlanSpan("question", 0, ids, "fresh")], "full"),
                                   parse_policy("full"), allocate=self._allocate)
            elapsed = time.perf_counter() - start
            self._give_back(result)
            return elapsed

    def _run(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, extra_capacity: int,
             allocate: Callable[[int], KVBuffer] | None = None) -> tuple[PlannedRequest, PrefillResult]:
        """A request's prefill outside the scheduler: plan, prefill with room for
        `extra_capacity` more tokens, check, commit."""
        planned = self.cache.plan(prompt, policy, tenant)
        planned, result = self.prefill.run(planned, planned.plan.num_tokens + extra_capacity, {},
                                           allocate=allocate)
        self.cache.commit(planned, result, tenant)
        return planned, result

    def _give_back(self, result: PrefillResult) -> None:
        """The probe's KV buffer to the pool: what it returns (logits) holds no view of it."""
        if self.kv_pool is not None:
            self.kv_pool.give(result.kv)
