"""One generation request's state, from admission to its last token.

The scheduler thread moves a Sequence through prefill and decode steps; the caller's thread reads
what it produced (text deltas, then the GenerationResult, or an exception) from its outbox.
Everything here is per request: no engine state.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_sidecar.engine.sampling import TextAccumulator, choose_token
from ragcache_integrations.types import ChunkedPrompt, GenerationResult, GenerationStats, SamplingParams

if TYPE_CHECKING:
    from engine_sidecar.engine.prefill_stage import PrefillTask
    from engine_sidecar.execution.batched_decode import DecodeKV
    from engine_sidecar.execution.kv_buffer import KVBuffer
    from engine_sidecar.execution.policies import Policy
    from engine_sidecar.reuse.planner import PlannedRequest

_DONE = object()  # the outbox's last item: nothing follows


@dataclass(eq=False)
class Sequence:
    sampling: SamplingParams
    policy: Policy
    tenant: str
    prompt: ChunkedPrompt | None  # None for a plain chat completion (planned up front)
    planned: PlannedRequest | None
    prompt_tokens: int  # before planning: what admission reserves KV for
    t0: float  # arrival: TTFT counts the wait for admission too
    times: dict[str, float] = field(default_factory=dict)
    kv: DecodeKV | None = None
    prefill: PrefillTask | None = None  # its prefill while it runs across scheduler steps
    prefill_spent: int = 0  # token-layers its last prefill step ran
    stats: GenerationStats | None = None
    text: TextAccumulator | None = None
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed back through the model
    finish_reason: str = "length"
    decode_started: float = 0.0
    cancelled: threading.Event = field(default_factory=threading.Event)
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    # takes the KV back when the sequence lets go of it (the engine's KVPool on a CPU, its block pool)
    on_release: Callable[[DecodeKV], None] | None = None

    @property
    def reserved_tokens(self) -> int:
        """KV rows this sequence may need: its prompt, every new token and one spare (what it was
        admitted with, once it holds KV)."""
        if self.kv is not None:
            return self.kv.capacity
        return self.prompt_tokens + self.sampling.max_tokens + 1

    @property
    def rows_to_resume(self) -> int:
        """KV rows it needs to go on: its prompt and answer so far, and the next token's."""
        prompt = self.planned.plan.num_tokens if self.planned is not None else self.prompt_tokens
        return prompt + len(self.generated) + 1

    # --- scheduler side ------------------------------------------------------------------------
    def begin_decoding(self, logits: torch.Tensor, kv: KVBuffer, stats: GenerationStats, decode: Callable[[list[int]], str],
                       stop_ids: set[int]) -> bool:
        """After the prefill: keep the KV and sample the first token. True while more tokens are
        wanted."""
        self.kv, self.stats = kv, stats
        self.text = TextAccumulator(decode, self.sampling.stop)
        eos = set() if self.sampling.ignore_eos else stop_ids
        self.stop_ids = frozenset(eos | set(self.sampling.stop_token_ids))
        seed = self.sampling.seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        self.decode_started = time.perf_counter()
        return self.accept(logits)

    def accept(self, logits: torch.Tensor) -> bool:
        """Sample from the next-token logits and emit its text. True while more tokens are wanted
        (then `next_token` is the one to feed back)."""
        return self.accept_token(choose_token(logits, self.sampling, self.generator))

    def accept_token(self, token: int) -> bool:
        """Emit a chosen token's text (a decode step chooses the whole batch's at once)."""
        assert self.text is not None
        self.next_token = None
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return False
        self.generated.append(token)
        self.outbox.put(self.text.add(token))  # "" when the token added no text yet: one item per token
        if self.text.stopped:
            self.finish_reason = "stop"
            return False
        if len(self.generated) >= self.sampling.max_tokens:
            return False
        self.next_token = token
        return True

    def finish(self) -> GenerationResult:
        """The last text held back (if any) and the result; the caller puts them out."""
        assert self.text is not None and self.stats is not None
        tail = self.text.finish()
        if tail:
            self.outbox.put(tail)
        self.times["decode_s"] = time.perf_counter() - self.decode_started
        self.stats.decode_tokens = len(self.generated)
        self.stats.stage_times = self.times
        result = GenerationResult(text=self.text.text, token_ids=list(self.generated),
                                  finish_reason=self.finish_reason, stats=self.stats)
        self.outbox.put(result)
        self.outbox.put(_DONE)
        return result

    def fail(self, exc: BaseException) -> None:
        self.outbox.put(exc)
        self.outbox.put(_DONE)

    def release(self) -> None:
        """Let go of the KV buffer (it is large) as soon as the sequence is out of the running set:
        to `on_release` where given, which may hand it to the next request. A prefill still in
        progress is stopped."""
        prefill, self.prefill = self.prefill, None
        if prefill is not None:
            prefill.close()
        kv, self.kv = self.kv, None
        if kv is not None and self.on_release is not None:
            self.on_release(kv)

    # --- caller side ---------------------------------------------------------------------------
    def events(self) -> Iterator[str | GenerationResult]:
        """What the scheduler produced, in order; an exception it recorded is raised here. Closing
        the iterator early cancels the sequence (the scheduler drops it at its next step)."""
        try:
            while True:
                item = self.outbox.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancelled.set()


class GenerationStream:
    """Iterate for text deltas; `.result` holds the full GenerationResult once iteration ends."""

    def __init__(self, events: Iterator[str | GenerationResult]):
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        for event in self.ticks():
            if event:
                yield event

    def ticks(self) -> Iterator[str]:
        """Like iterating, plus an empty string for every token that added no text yet (held
        back for a stop string, or an incomplete character): a consumer that checks for
        cancellation between items sees one item per generated token."""
        try:
            for event in self._events:
                if isinstance(event, GenerationResult):
                    self.result = event
                else:
                    yield event
        finally:
            self.close()

    def close(self) -> None:
        """Stop the generation (a no-op once it finished): its sequence leaves the batch."""
        close = getattr(self._events, "close", None)
        if close is not None:
            close()
