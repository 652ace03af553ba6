"""One request's prefill as the engine runs it: the plan executed with disk-tier KV prefetched
layer by layer (at Cache-Craft's preload depth from measured costs), the costs learned, what was
read promoted to RAM, and one retry with whole-file reads when a file turns out damaged."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine_sidecar.execution.fused_prefill import PrefillResult, fused_prefill
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.prefetch import preload_depth
from engine_sidecar.execution.prefill_graphs import PrefillGraphs
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.reuse.cache import ReuseCache
from engine_sidecar.reuse.planner import PlannedRequest
from engine_sidecar.store.disk import DamagedCacheFile


class PrefillStage:
    def __init__(self, runner: ModelRunner, cache: ReuseCache, graphs: PrefillGraphs | None = None):
        """`graphs`, where given, replays each prefill's layers after its policy's last choice of
        rows from CUDA graphs."""
        self.runner, self.cache, self.graphs = runner, cache, graphs
        self.store, self.costs = cache.store, cache.costs

    def run(self, planned: PlannedRequest, capacity: int, times: dict[str, float], upto: int | None = None,
            allocate: Callable[[int], KVBuffer] | None = None) -> tuple[PlannedRequest, PrefillResult]:
        """Run the plan with its policy (disk-tier KV prefetched layer by layer), learn costs,
        promote what was read to RAM. A file found damaged mid-read was deleted: the request is
        planned again from its prompt, reading whole files. With `upto`, only the spans that start
        before it run, without logits (a prefill another engine finishes)."""
        for attempt in (0, 1):
            started = time.perf_counter()
            plan, observer = planned.plan, planned.observer()
            if upto is not None:
                plan, observer = FusionPlan([s for s in plan.spans if s.start < upto], plan.policy), None
            assert planned.policy is not None, "a plan from ReuseCache.plan names its policy"
            try:
                result = fused_prefill(self.runner, plan, planned.policy, capacity=capacity, need_logits=upto is None,
                                       observer=observer, prefetch_depth=self._preload_depth(planned),
                                       allocate=allocate, graphs=self.graphs)
            except DamagedCacheFile:
                if attempt or planned.prompt is None:
                    raise
                # read whole files this time: each is verified before use, damaged ones are misses
                planned = self.cache.plan(planned.prompt, planned.policy, planned.tenant, lazy=False)
                continue
            times["prefill_s"] = time.perf_counter() - started
            times.update(result.stage_s)
            self._observe_costs(result, times["prefill_s"])
            if result.prefetch is not None:
                times["prefetch_read_s"] = result.prefetch.read_s
                times["prefetch_wait_s"] = result.prefetch.wait_s
                times["prefetch_depth"] = float(result.prefetch.depth)
                times["prefetch_rows_skipped"] = float(result.prefetch.rows_skipped)
                for entry in result.prefetched:
                    self.store.promote(entry)
            return planned, result
        raise AssertionError("unreachable")

    def _preload_depth(self, planned: PlannedRequest) -> int:
        """Cache-Craft's preload depth for this plan, from the costs measured so far."""
        lazy = sum(len(s) for s in planned.plan.spans if s.cached is not None and s.cached.reader is not None)
        if not lazy or self.costs.compute is None or "disk" not in self.costs.load:
            return 1
        layers = self.runner.num_layers
        computed = sum(len(s) for s in planned.plan.spans if s.mode == "fresh") + 0.15 * lazy
        return preload_depth(layers, self.costs.compute * computed / layers, self.costs.load["disk"] * lazy / layers)

    def _observe_costs(self, result: PrefillResult, prefill_s: float) -> None:
        self.costs.observe_load("ram", result.load_s, result.loaded_tokens)
        waited = result.prefetch.wait_s if result.prefetch is not None else 0.0
        self.costs.observe_compute(prefill_s - result.load_s - waited,
                                   result.token_layers_computed / self.runner.num_layers)
        if result.prefetch is not None:
            self.costs.observe_load("disk", result.prefetch.read_s, result.prefetch.tokens)
