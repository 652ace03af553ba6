"""Concurrent requests served in batches: a waiting queue, a running set, one stepping thread.

Each step prefills waiting sequences, oldest first, while the running set has room in sequences
and in reserved KV rows and their prompts stay within the step's prefill token budget (one is
always taken, whatever its length), then runs one batched decode step over every running
sequence, the new ones included. While sequences are decoding, a step's prefills also stop after
the budget's tokens times the model's layers in token-layers computed: a longer prefill pauses
between two layers and goes on in the next step, before anyone new is admitted. A running stream
therefore waits at most about one budget's worth of prefill between two of its tokens, however
long the prompts; a new request's first token waits for the prefills ahead of it and for one
decode step per step its own prefill or theirs spans. The
engine's lock is held for one step at a time, so warm-ups, cache clears and fidelity probes
interleave between steps.

A failure belongs to the sequence it came from: an exception in one sequence's prefill, sampling
or completion fails that request and frees its slot while the others keep stepping. A fault
outside any one sequence stops the loop; then every queued and running request fails at once,
new ones are refused, and `failure` says why (`/health` answers 503 with it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine_sidecar.engine.sampling import choose_tokens
from engine_sidecar.engine.sequence import Sequence
from engine_sidecar.errors import EngineUnavailableError, PromptTooLongError
from engine_sidecar.execution.batched_decode import DecodeKV
from engine_sidecar.execution.block_pool import BlockPool
from engine_sidecar.execution.decode_graphs import DecodeGraphs
from engine_sidecar.execution.paged_kv import PagedKV

log = logging.getLogger("ragcache.scheduler")

# One batched decode step: token i appended to KV i -> next-token logits [B, vocab]
# (the engine's is `decode_batch` over its model runner)
BatchDecode = Callable[[list[DecodeKV], list[int]], torch.Tensor]


class SequenceStepper(Protocol):
    """What the scheduler runs for one sequence, on the stepping thread with the lock held
    (`SequenceSteps` in the engine)."""

    def begin(self, seq: Sequence, budget: int | None = None) -> bool | None:
        """Plan and prefill the sequence and sample its first token: True while it wants more.
        With `budget`, run about that many token-layers of its prefill (at least one layer),
        setting `seq.prefill_spent`; None while the prefill is unfinished (call again)."""
        ...

    def complete(self, seq: Sequence) -> None:
        """After its last token: keep what it leaves behind and post its result."""
        ...


class SchedulerClosed(EngineUnavailableError):
    pass


@dataclass(frozen=True)
class KVRows:
    """KV rows (one per token, every layer) the running sequences hold: `reserved` is their buffers'
    capacity (prompt + max_tokens + 1 each, what admission counts), `used` the rows written so far.
    With a block pool, `blocks_used` counts the pool's blocks held, of `blocks_total`. Each `peak_` is
    the most seen at the end of a prefill or decode step since the engine started, or since
    `Scheduler.reset_kv_peaks`."""

    reserved: int = 0
    used: int = 0
    peak_reserved: int = 0
    peak_used: int = 0
    blocks_used: int = 0
    peak_blocks_used: int = 0
    blocks_total: int = 0


class Scheduler:
    def __init__(self, decode: BatchDecode, lock: threading.RLock, steps: SequenceStepper, max_batch: int,
                 kv_budget_tokens: int, graphs: DecodeGraphs | None = None, prefill_budget_tokens: int = 8192,
                 blocks: BlockPool | None = None, num_layers: int = 1):
        """`steps.begin(seq)` plans and prefills a sequence and samples its first token (True while
        it wants more); `steps.complete(seq)` runs after its last token. Both run on the stepping
        thread with `lock` held, as does `decode`, the batched decode step over the running
        sequences. `graphs`, where given, replays decode steps from CUDA graphs. A step prefills
        prompts of at most `prefill_budget_tokens` tokens together (at least one prompt). With
        `blocks`, the running sequences' KV is in that pool (`steps.begin` moves it there), a
        sequence is admitted by the blocks its rows take now (`_admit`), and a decode step that
        would run out preempts the newest (`_make_room`); `kv_budget_tokens` is then not used. While
        sequences are decoding, a step's prefills run at most `prefill_budget_tokens` x `num_layers`
        token-layers (at least one layer): a longer prefill goes on in the next step, after the
        running sequences' decode step."""
        self.decode, self.lock, self.graphs = decode, lock, graphs
        self.steps = steps
        self.max_batch = max(1, max_batch)
        self.kv_budget_tokens = kv_budget_tokens
        self.blocks = blocks
        self.prefill_budget_tokens = max(1, prefill_budget_tokens)
        self.prefill_budget_token_layers = self.prefill_budget_tokens * max(1, num_layers)
        self.prefill_splits = 0  # prefills paused for a decode step (for stats and tests)
        self.preemptions = 0  # sequences preempted from the block pool (for stats and tests)
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._starting: deque[Sequence] = deque()  # admitted, prefill not done (the first's may be part-way)
        self._running: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None  # why the stepping loop stopped on a fault, if it did
        self.steps_prefill = 0
        self.steps_decode = 0
        self.decode_batch_sum = 0  # sequences decoded over all decode steps (mean batch = sum / steps)
        self.peak_batch = 0
        self.kv_rows = KVRows()  # swapped whole by the stepping thread: readers need no lock

    @property
    def waiting(self) -> int:
        return len(self._waiting) + len(self._starting)

    @property
    def running(self) -> int:
        return len(self._running)

    def reset_kv_peaks(self) -> None:
        """Start the peaks again from what is held now (a benchmark's next load level)."""
        rows = self.kv_rows
        self.kv_rows = dataclasses.replace(rows, peak_reserved=rows.reserved, peak_used=rows.used,
                                           peak_blocks_used=rows.blocks_used)

    def submit(self, seq: Sequence) -> None:
        """Queue the sequence. Raises PromptTooLongError where the block pool could never hold it."""
        if self.blocks is not None and self.blocks.blocks_for(seq.reserved_tokens) > self.blocks.num_blocks:
            pool = self.blocks
            raise PromptTooLongError(
                f"the prompt's {seq.prompt_tokens} tokens and max_tokens {seq.sampling.max_tokens} need "
                f"{pool.blocks_for(seq.reserved_tokens)} KV blocks of {pool.block_size} rows; the pool holds "
                f"{pool.num_blocks} (--batch-kv-gb): lower max_tokens or shorten the prompt")
        with self._cond:
            if self.failure is not None:
                raise SchedulerClosed(f"the engine's scheduler stopped on a fault ({self.failure}); restart the server")
            if self._stopping:
                raise SchedulerClosed("the engine is closed")
            self._waiting.append(seq)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ragcache-scheduler", daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        """Stop stepping after the step in progress, without waiting for it; sequences still
        waiting or running then end with SchedulerClosed."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def close(self) -> None:
        """`stop`, then wait for the stepping thread to end."""
        self.stop()
        with self._cond:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=60)

    # --- the stepping thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._step_until_stopped()
        except BaseException as exc:  # a fault outside any one sequence: nothing may wait forever
            log.exception("the scheduler loop stopped")
            with self._cond:
                self.failure = f"{type(exc).__name__}: {exc}"
                pending = list(self._starting) + list(self._waiting) + self._running
                self._starting.clear()
                self._waiting.clear()
                self._running = []
            for seq in pending:
                seq.release()
                seq.fail(SchedulerClosed(f"the engine's scheduler stopped on a fault ({self.failure})"))

    def _step_until_stopped(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    pending = list(self._starting) + list(self._waiting) + self._running
                    self._starting.clear()
                    self._waiting.clear()
                    break
                if not self._starting:  # a prefill left unfinished goes on before anyone is admitted
                    self._starting.extend(self._admit())
            self._running = [s for s in self._running if not self._dropped(s)]
            self._starting = deque(s for s in self._starting if not self._dropped(s))
            with self.lock:
                self._prefill_step()
                if self._running:
                    self._decode()
                self._note_kv()  # what is held after the step (finished sequences let go of theirs)
        for seq in pending:
            seq.release()
            seq.fail(SchedulerClosed("the engine was closed before this request finished"))
        self._running = []

    def _dropped(self, seq: Sequence) -> bool:
        if seq.cancelled.is_set():  # its reader is gone: free its KV now
            seq.release()
            return True
        return False

    def _admit(self) -> list[Sequence]:
        """The oldest waiting sequences that fit beside the running ones, in arrival order, while
        their prompts stay within the prefill budget. The first always fits the budget, and fits
        the KV rows when nothing runs (a request larger than the KV budget runs, alone). With a
        block pool, a sequence fits while the free blocks hold its rows so far (prompt, answer so
        far for one preempted, and the next token's) with a block to spare for every sequence
        decoding beside it; `submit` refused any the whole pool cannot hold to its end."""
        admitted: list[Sequence] = []
        reserved = sum(s.reserved_tokens for s in self._running)
        free_blocks = self.blocks.free_blocks - len(self._running) if self.blocks is not None else 0
        prompt_tokens = 0
        while self._waiting:
            head = self._waiting[0]
            if head.cancelled.is_set():
                self._waiting.popleft()
                continue
            if len(self._running) + len(admitted) >= self.max_batch:
                break
            alone = not self._running and not admitted
            if self.blocks is not None:
                need = self.blocks.blocks_for(head.rows_to_resume) + 1  # and its spare block
                if need > free_blocks:
                    break
                free_blocks -= need
            elif not alone and reserved + head.reserved_tokens > self.kv_budget_tokens:
                break
            if admitted and prompt_tokens + head.prompt_tokens > self.prefill_budget_tokens:
                break
            admitted.append(self._waiting.popleft())
            reserved += head.reserved_tokens
            prompt_tokens += head.prompt_tokens
        return admitted

    def _make_room(self) -> None:
        """Before a decode step from the block pool: while the running sequences' next rows need
        more blocks than are free, the newest one is preempted (its blocks freed, it goes back to
        the head of the queue and its KV is recomputed when it is admitted again). The oldest is
        never preempted: `submit` made sure it fits alone."""
        assert self.blocks is not None
        pool = self.blocks
        need = {id(s): pool.blocks_to_append(s.kv.table, 1) for s in self._running if isinstance(s.kv, PagedKV)}
        preempted: list[Sequence] = []
        while sum(need.values()) > pool.free_blocks and len(self._running) > 1:
            seq = self._running.pop()
            need.pop(id(seq), None)
            seq.release()
            preempted.append(seq)
        if preempted:
            self.preemptions += len(preempted)
            with self._cond:
                self._waiting.extendleft(preempted)  # the newest last: oldest first again

    def _prefill_step(self) -> None:
        """This step's prefills, oldest first. With sequences decoding, within the step's budget
        of token-layers: the one that exhausts it stays first in line, unfinished. A sequence's
        error (bad prompt, damaged file...) fails it alone."""
        budget = self.prefill_budget_token_layers if self._running else None
        while self._starting:
            seq = self._starting[0]
            if seq.prefill is None:
                self.steps_prefill += 1
            try:
                more = self.steps.begin(seq, budget)
            except BaseException as exc:
                self._starting.popleft()
                seq.release()
                seq.fail(exc)
                continue
            if more is None:
                self.prefill_splits += 1
                return  # paused: the running sequences decode first
            self._starting.popleft()
            self._note_kv(seq)
            if more:
                self._running.append(seq)
            else:
                self._finish(seq)
            if budget is not None:
                budget -= seq.prefill_spent
                if budget <= 0:
                    return

    def _note_kv(self, also: Sequence | None = None) -> None:
        """Count the KV rows the running sequences (and `also`, just prefilled) hold now."""
        held = [s.kv for s in (self._running if also is None else [*self._running, also]) if s.kv is not None]
        reserved, used = sum(kv.capacity for kv in held), sum(kv.length for kv in held)
        rows = self.kv_rows
        blocks = self.blocks.num_blocks - self.blocks.free_blocks if self.blocks is not None else 0
        self.kv_rows = KVRows(reserved, used, max(rows.peak_reserved, reserved), max(rows.peak_used, used),
                              blocks, max(rows.peak_blocks_used, blocks),
                              self.blocks.num_blocks if self.blocks is not None else 0)

    def _decode(self) -> None:
        if self.blocks is not None:
            self._make_room()
        batch = self._running
        self.steps_decode += 1
        self.decode_batch_sum += len(batch)
        self.peak_batch = max(self.peak_batch, len(batch))
        try:
            kvs = [s.kv for s in batch]
            tokens = [s.next_token for s in batch]
            assert all(kv is not None for kv in kvs) and all(t is not None for t in tokens)
            logits = self.graphs.decode(kvs, tokens) if self.graphs is not None else None  # type: ignore[arg-type]
            if logits is None:
                logits = self.decode(kvs, tokens)  # type: ignore[arg-type]
            choices = choose_tokens(logits, [s.sampling for s in batch], [s.generator for s in batch])
            self._note_kv()
        except BaseException as exc:  # every sequence in the step is affected alike
            log.exception("batched decode step failed")
            for seq in batch:
                seq.release()
                seq.fail(exc)
            self._running = []
            return
        still: list[Sequence] = []
        for seq, choice in zip(batch, choices, strict=True):
            try:
                if isinstance(choice, Exception):
                    raise choice
                more = seq.accept_token(choice)
            except Exception as exc:  # this sequence's own (its sampling, its text): the others go on
                seq.release()
                seq.fail(exc)
                continue
            if more:
                still.append(seq)
            else:
                self._finish(seq)
        self._running = still

    def _finish(self, seq: Sequence) -> None:
        try:
            self.steps.complete(seq)
        except BaseException as exc:
            seq.fail(exc)
        finally:
            seq.release()
