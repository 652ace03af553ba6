"""One request's prefill as the engine runs it: the plan executed with disk-tier KV prefetched
layer by layer (at Cache-Craft's preload depth from measured costs), whole or a few layers per
scheduler step, the costs learned, what was read promoted to RAM, and one retry with whole-file
reads when a file turns out damaged."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

from engine_sidecar.execution.fused_prefill import PrefillResult, fused_prefill_steps
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
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
        """Run the plan whole (`start` says how); the plan it ran (replanned after a damaged file)
        and the result."""
        task = self.start(planned, capacity, times, upto, allocate)
        task.advance(None)
        assert task.result is not None
        return task.planned, task.result

    def start(self, planned: PlannedRequest, capacity: int, times: dict[str, float], upto: int | None = None,
              allocate: Callable[[int], KVBuffer] | None = None,
              continuation: tuple[int, ...] | None = None) -> PrefillTask:
        """A prefill to advance a few layers at a time: the plan run with its policy (disk-tier KV
        prefetched layer by layer); once finished, the costs learned and what was read promoted to
        RAM. A file found damaged mid-read was deleted: the request is planned again from its
        prompt, reading whole files. With `upto`, only the spans that start before it run,
        without logits (a prefill another engine finishes). With a `continuation`, those tokens
        follow the plan as a span computed in full, without logits (a preempted sequence's answer
        so far, recomputed; () for one preempted after its first token)."""
        return PrefillTask(self, planned, capacity, times, upto, allocate, continuation)

    def _finished(self, task: PrefillTask) -> None:
        result, times = task.result, task.times
        assert result is not None
        times["prefill_s"] = task.active_s
        times.update(result.stage_s)
        self._observe_costs(result, task.active_s)
        if result.prefetch is not None:
            times["prefetch_read_s"] = result.prefetch.read_s
            times["prefetch_wait_s"] = result.prefetch.wait_s
            times["prefetch_depth"] = float(result.prefetch.depth)
            times["prefetch_rows_skipped"] = float(result.prefetch.rows_skipped)
            for entry in result.prefetched:
                self.store.promote(entry)

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


class PrefillTask:
    """One request's prefill in progress: `advance` runs its next layers. `active_s` counts the
    time spent in it, not the pauses between calls (other sequences' decode steps)."""

    def __init__(self, stage: PrefillStage, planned: PlannedRequest, capacity: int, times: dict[str, float],
                 upto: int | None, allocate: Callable[[int], KVBuffer] | None,
                 continuation: tuple[int, ...] | None = None):
        self.stage, self.planned, self.capacity, self.times = stage, planned, capacity, times
        self.upto, self.allocate, self.continuation = upto, allocate, continuation
        self.retried = False
        self.active_s = 0.0
        self._computed = 0  # token-layers the current attempt reported so far
        self.result: PrefillResult | None = None
        self._steps = self._begin()

    def _begin(self) -> Generator[int, None, PrefillResult]:
        planned, stage = self.planned, self.stage
        plan, observer = planned.plan, planned.observer()
        if self.upto is not None:
            plan, observer = FusionPlan([s for s in plan.spans if s.start < self.upto], plan.policy), None
        if self.continuation is not None:
            observer = None
        if self.continuation:
            answer = PlanSpan("question", plan.num_tokens, self.continuation, "fresh")
            plan = FusionPlan([*plan.spans, answer], plan.policy)
        assert planned.policy is not None, "a plan from ReuseCache.plan names its policy"
        return fused_prefill_steps(stage.runner, plan, planned.policy, capacity=self.capacity,
                                   need_logits=self.upto is None and self.continuation is None, observer=observer,
                                   prefetch_depth=stage._preload_depth(planned), allocate=self.allocate,
                                   graphs=stage.graphs)

    def advance(self, budget: int | None) -> int:
        """Run layers until `budget` token-layers are done this call (at least one layer), or to
        the end with None; the token-layers it ran. `result` is set once the prefill is done."""
        started = time.perf_counter()
        done = 0
        try:
            while self.result is None and (budget is None or done < budget):
                try:
                    so_far = next(self._steps)
                except StopIteration as finished:
                    self.result = finished.value
                    so_far = self.result.token_layers_computed
                except DamagedCacheFile:
                    if self.retried or self.planned.prompt is None:
                        raise
                    # read whole files this time: each is verified before use, damaged ones are misses
                    self.retried = True
                    planned = self.planned
                    self.planned = self.stage.cache.plan(planned.prompt, planned.policy, planned.tenant, lazy=False)
                    self._steps, self._computed = self._begin(), 0
                    continue
                done += so_far - self._computed
                self._computed = so_far
        finally:
            self.active_s += time.perf_counter() - started
        if self.result is not None:
            self.stage._finished(self)
        return done

    def close(self) -> None:
        """Stop it unfinished (its disk reads end first: nothing writes into its buffer after)."""
        self._steps.close()
