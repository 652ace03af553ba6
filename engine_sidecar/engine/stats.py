"""A request's GenerationStats from its plan and its prefill: what was reused, recomputed and
computed, counted honestly (inline precompute included, queued background work apart)."""

from __future__ import annotations

from engine_sidecar.execution.fused_prefill import PrefillResult
from engine_sidecar.reuse.planner import PlannedRequest
from ragcache_integrations.types import GenerationStats


def request_stats(planned: PlannedRequest, result: PrefillResult, ttft: float,
                  times: dict[str, float], num_layers: int, convention: str) -> GenerationStats:
        plan = planned.plan
        total = plan.num_tokens
        cached = sum(len(s) for s in plan.spans if s.mode != "fresh")
        recomputed = result.fused_tokens_recomputed
        layers = num_layers
        # all work done for this request, inline precompute included; queued background work apart
        work = result.token_layers_computed + planned.precompute_token_layers
        background = layers * sum(len(seg.token_ids) + len(seg.lead) + (len(prefix.token_ids) if convention ==
                                                                         "after-prefix" else 0)
                                  for seg, prefix in planned.background)
        if planned.precompute_s:
            times["precompute_s"] = planned.precompute_s
        return GenerationStats(
            ttft_s=ttft,
            prefill_tokens_total=total,
            tokens_reused=cached - recomputed,
            tokens_recomputed=recomputed,
            tokens_computed_fresh=total - cached,
            tokens_fused=sum(len(s) for s in plan.spans if s.mode == "fuse") - recomputed,
            chunk_hits=planned.hits,
            chunk_misses=planned.misses,
            computed_fraction=work / max(1, total * layers),
            token_layers_computed=work,
            token_layers_precomputed=planned.precompute_token_layers,
            token_layers_background=background,
            policy=plan.policy,
            policy_decisions=result.decisions,
            stage_times=times,
            plan=plan.describe(),
            notes=plan.notes,
            chunks_deduplicated=len(planned.dropped_chunk_ids),
        )
