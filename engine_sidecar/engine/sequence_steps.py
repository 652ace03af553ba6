"""What the scheduler runs for one sequence: its prefill step (plan from the reuse cache, prefill,
first token, then the commit of what the prefill computed, then its KV moved into the block pool
where the engine has one) and its completion (its conversation kept, its background precompute
queued, its result posted). Both run on the stepping thread with the engine lock held."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine_sidecar.engine.prefill_stage import PrefillStage
from engine_sidecar.engine.sequence import Sequence
from engine_sidecar.engine.stats import request_stats
from engine_sidecar.engine.verify import FirstTokenVerifier
from engine_sidecar.errors import NON_FINITE_MESSAGE, NonFiniteKVError
from engine_sidecar.execution.batched_decode import DecodeKV
from engine_sidecar.execution.block_pool import BlockPool
from engine_sidecar.execution.kv_pool import KVPool
from engine_sidecar.execution.paged_kv import PagedKV
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.reuse.cache import ReuseCache
from engine_sidecar.reuse.turn_history import conversation_after_turn
from engine_sidecar.store.entry import finite_kv


class SequenceSteps:
    def __init__(self, cache: ReuseCache, prefill: PrefillStage, runner: ModelRunner,
                 decode: Callable[[list[int]], str], eos_ids: set[int], convention: str,
                 kv_pool: KVPool | None = None, verifier: FirstTokenVerifier | None = None,
                 blocks: BlockPool | None = None):
        self.cache, self.prefill, self.runner, self.decode, self.eos_ids = cache, prefill, runner, decode, eos_ids
        self.convention = convention
        self.kv_pool = kv_pool  # where sequences' KV buffers come from and go back to (a CPU's)
        self.verifier = verifier
        self.blocks = blocks  # where decode KV lives, if anywhere but each sequence's own buffer

    def begin(self, seq: Sequence, budget: int | None = None) -> bool | None:
        """Scheduler step (engine lock held): plan, prefill, keep what the prefill computed, sample
        the first token. True while the sequence wants more tokens. With `budget`, the prefill
        runs about that many token-layers (at least one layer) and, unfinished, returns None:
        call again (with `seq.prefill_spent` telling what this call ran). A sequence preempted
        from the block pool has its KV recomputed instead (`seq.generated` is not empty)."""
        if seq.prefill is None and seq.generated:
            assert seq.planned is not None and self.blocks is not None
            # its KV held the prompt and every answer token but the last (the next one fed back)
            answer = tuple(seq.generated[:-1])
            seq.prefill = self.prefill.start(seq.planned, max(1, seq.planned.plan.num_tokens + len(answer)), {},
                                             allocate=self.kv_pool.take if self.kv_pool is not None else None,
                                             continuation=answer)
        if seq.prefill is None:  # its first call: plan (unless planned up front), set the prefill going
            started = time.perf_counter()
            seq.times["queue_s"] = started - seq.t0 - seq.times.get("tokenize_s", 0.0)
            planned = seq.planned
            if planned is None:
                assert seq.prompt is not None
                planned = self.cache.plan(seq.prompt, seq.policy, seq.tenant, answer_tokens=seq.sampling.max_tokens)
                seq.times["plan_s"] = time.perf_counter() - started
            # with a block pool the prefill's buffer holds the prompt only: decode grows blocks
            capacity = planned.plan.num_tokens + seq.sampling.max_tokens + 1 if self.blocks is None \
                else max(1, planned.plan.num_tokens)
            seq.on_release = self._let_go
            seq.prefill = self.prefill.start(planned, capacity, seq.times,
                                             allocate=self.kv_pool.take if self.kv_pool is not None else None)
        task = seq.prefill
        assert task is not None
        seq.prefill_spent = task.advance(budget)
        if task.result is None:
            return None
        seq.prefill = None
        planned, result = task.planned, task.result
        reserved = planned.plan.num_tokens + seq.sampling.max_tokens + 1
        if task.continuation is not None:  # resumed: back into the pool, decoding from its next token
            assert self.blocks is not None and seq.next_token is not None
            seq.kv = PagedKV.from_buffer(self.blocks, result.kv, reserved)
            self._let_go(result.kv)
            seq.times["resumed"] = seq.times.get("resumed", 0.0) + 1
            return True
        seq.planned = planned
        assert result.logits is not None
        stats = request_stats(planned, result, time.perf_counter() - seq.t0, seq.times,
                              self.runner.num_layers, self.convention)
        more = seq.begin_decoding(result.logits, result.kv, stats, self.decode, self.eos_ids)
        # the first token is out (its choice checked the logits are finite): what the prefill
        # computed is kept now, off the time to first token, and before any decode step (or a
        # next request) could want it
        committed = time.perf_counter()
        self.cache.commit(planned, result, seq.tenant, check_logits=False)
        seq.times["commit_s"] = time.perf_counter() - committed
        if self.verifier is not None and self.verifier.due(planned.plan):
            verified = time.perf_counter()
            stats.verified_first_token = self.verifier.check(planned.plan, result.logits)
            seq.times["verify_s"] = time.perf_counter() - verified
        if self.blocks is not None:
            seq.kv = PagedKV.from_buffer(self.blocks, result.kv,
                                          max(reserved, seq.prompt_tokens + seq.sampling.max_tokens + 1))
            self._let_go(result.kv)
        return more

    def _let_go(self, kv: DecodeKV) -> None:
        """A sequence's KV it no longer reads: blocks back to the pool, a buffer to the KVPool."""
        if isinstance(kv, PagedKV):
            kv.release()
        elif self.kv_pool is not None:
            self.kv_pool.give(kv)

    def complete(self, seq: Sequence) -> None:
        """Scheduler step after a sequence's last token: keep its conversation and queue its
        background precompute, then post the result (a caller that acts on the result at once,
        with a next turn or `wait_background`, finds both done)."""
        assert seq.planned is not None and seq.kv is not None
        if seq.prompt is not None and seq.prompt.conversation_id:
            kv = seq.kv.to_buffer(self.runner) if isinstance(seq.kv, PagedKV) else seq.kv
            turn = conversation_after_turn(self.runner, seq.prompt, seq.planned, kv, seq.generated, seq.tenant)
            if not finite_kv(turn.history.keys, turn.history.values):
                raise NonFiniteKVError(NON_FINITE_MESSAGE)  # the next turn would read it
            self.cache.keep_conversation(turn)
        self.cache.precompute_later(seq.planned, seq.tenant)
        seq.finish()
