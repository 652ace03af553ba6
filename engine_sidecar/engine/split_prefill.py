"""A prefill shared with another engine (the vLLM connector): ragcache computes the KV of the
prompt's leading spans (its stored chunks, fused by the policy), the other engine computes the
rest in context, and ragcache then keeps what was new from the KV that engine holds.

`prefix` plans the whole prompt as a normal request would and runs the fused prefill over the
spans that start before `upto` only (a span the plan computes fresh among them is computed in
place, as in any request). `learn` receives the whole prompt's KV as the other engine holds it
(keys rotated to their positions), takes ragcache's own rows where it computed them, undoes the
rotation elsewhere and commits exactly as a successful prefill would: misses in place with their
context, CP-Tree nodes, the template prefix."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine_sidecar.engine.prefill_stage import PrefillStage
from engine_sidecar.engine.request_prep import RequestPreparer
from engine_sidecar.execution.fused_prefill import PrefillResult
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.policies import Policy
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.reuse.cache import ReuseCache
from engine_sidecar.reuse.planner import PlannedRequest
from ragcache_integrations.types import ChunkedPrompt
from ragcache_kernels.dispatch import apply_rope


@dataclass
class PrefixRun:
    """What ragcache computed for one request: its plan and the KV of positions [0, end)."""

    planned: PlannedRequest
    policy: Policy
    tenant: str
    token_ids: list[int]
    end: int  # ragcache's KV covers [0, end): whole spans
    result: PrefillResult | None  # None when nothing was computed (end == 0)

    @property
    def chunk_hits(self) -> int:
        return sum(1 for s in self.planned.plan.spans if s.kind == "chunk" and s.mode != "fresh")

    @property
    def token_layers(self) -> int:
        return self.result.token_layers_computed if self.result is not None else 0


class SplitPrefill:
    def __init__(self, runner: ModelRunner, prep: RequestPreparer, cache: ReuseCache, prefill: PrefillStage,
                 lock: threading.RLock):
        self.runner, self.prep, self.cache, self.prefill = runner, prep, cache, prefill
        self._lock = lock  # the engine's

    def prefix(self, prompt: ChunkedPrompt | dict, policy: str | Policy, tenant: str, upto: int) -> PrefixRun:
        """Plan the prompt (chunks in the given order) and compute the KV of the spans that start
        before `upto`; nothing is stored yet (see `learn`)."""
        prompt, _, pol = self.prep.prepare(prompt, None, policy, "preserve", tenant)
        self.prep.validate(prompt, 1)
        with self._lock:
            planned = self.cache.plan(prompt, pol, tenant, lazy=False)
            spans = [s for s in planned.plan.spans if s.start < upto]
            result = None
            if spans:
                # the plan's own spans up to `upto`, as any request prefills them (store reads, the
                # retry on a damaged file, cost learning); kept only in `learn`
                planned, result = self.prefill.run(planned, spans[-1].end, {}, upto=upto)
                spans = [s for s in planned.plan.spans if s.start < upto]
        end = spans[-1].end if spans else 0
        return PrefixRun(planned, pol, tenant, planned.plan.token_ids, end, result)

    def learn(self, run: PrefixRun, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Commit the request with the whole prompt's KV `keys` (rotated), `values` [L, n, Hkv, D]
        as the other engine holds them: ragcache's own rows for [0, run.end), the rest unrotated."""
        n = len(run.token_ids)
        if keys.shape[1] != n or values.shape[1] != n:
            raise ValueError(f"KV for {keys.shape[1]} tokens given, the prompt has {n}")
        dtype, device = self.runner.dtype, self.runner.device
        keys, values = keys.to(dtype=dtype, device=device), values.to(dtype=dtype, device=device)
        rope = self.runner.rope_tables(torch.arange(n, device=device))
        # R(-θ) undoes R(θ): same cosines, negated sines
        keys_pre = torch.stack([apply_rope(keys[layer], cos, -sin)
                                for layer, (cos, sin) in enumerate(map(rope.at, range(keys.shape[0])))])
        if run.result is not None:
            own = run.result.kv
            keys_pre[:, : run.end] = own.keys_pre[:, : run.end]
            values = values.clone()
            values[:, : run.end] = own.values[:, : run.end]
        kv = KVBuffer(keys_pre, keys, values, n)
        with self._lock:
            self.cache.commit(run.planned, PrefillResult(None, kv, 0, 0, 0), run.tenant)
