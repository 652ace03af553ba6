"""The scheduler on its own, with no model: fake prefill/completion steps and a fake batched
decode step, written here, drive real Sequences through the real stepping thread.

Nothing here waits on a clock: a step that must stay in progress blocks on an Event the test
sets, and every wait for an answer has a generous timeout, so a scheduler that never answers
fails the test instead of hanging it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from engine_sidecar.engine.scheduler import Scheduler, SchedulerClosed
from engine_sidecar.engine.sequence import Sequence
from engine_sidecar.errors import NonFiniteLogitsError
from engine_sidecar.execution.policies import parse_policy
from ragcache_integrations.types import GenerationResult, GenerationStats, SamplingParams

VOCAB = 64
EOS = 0
WAIT_S = 60.0  # generous: only a broken scheduler gets anywhere near it


def one_hot(token: int) -> torch.Tensor:
    """Logits whose greedy choice is `token`."""
    row = torch.full((VOCAB,), -1.0)
    row[token] = 1.0
    return row


def spell(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


class FakeKV:
    """What the scheduler reads of a KV buffer: the rows it reserves, those written (the prompt's,
    then one per decode step) and whose it is."""

    def __init__(self, capacity: int, owner: str = "", length: int = 0):
        self.capacity, self.owner, self.length = capacity, owner, length


class FakeSteps:
    """Prefill and completion without a model: a sequence's first token is the one `first` names
    for it. Sequences named in `gated` wait in their prefill (`entered` says one does) until
    `gate` is set; those in `fail_begin` / `fail_complete` raise there; `on_release` is handed
    to each sequence as its KV pool would be."""

    def __init__(self, first: dict[str, int], gated: frozenset[str] = frozenset(),
                 fail_begin: frozenset[str] = frozenset(), fail_complete: frozenset[str] = frozenset(),
                 on_release=None):
        self.first, self.gated = first, gated
        self.fail_begin, self.fail_complete, self.on_release = fail_begin, fail_complete, on_release
        self.gate = threading.Event()
        self.entered = threading.Event()  # a gated sequence's prefill is in progress
        self.begun: list[str] = []
        self.completed: list[str] = []
        self.threads: set[threading.Thread] = set()

    def begin(self, seq: Sequence, budget: int | None = None) -> bool:
        self.threads.add(threading.current_thread())
        self.begun.append(seq.tenant)
        if seq.tenant in self.gated:
            self.entered.set()
            if not self.gate.wait(WAIT_S):
                raise AssertionError("the test never opened the gate")
        if seq.tenant in self.fail_begin:
            raise ValueError(f"bad prompt {seq.tenant}")
        seq.on_release = self.on_release
        kv = FakeKV(seq.reserved_tokens, seq.tenant, seq.prompt_tokens)
        return seq.begin_decoding(one_hot(self.first[seq.tenant]), kv, GenerationStats(), spell, {EOS})  # type: ignore[arg-type]

    def complete(self, seq: Sequence) -> None:
        self.completed.append(seq.tenant)
        if seq.tenant in self.fail_complete:
            raise OSError(f"could not keep {seq.tenant}'s conversation")
        seq.finish()


class LayeredSteps(FakeSteps):
    """FakeSteps whose prefills cost `cost[name]` token-layers, run as far as each call's budget
    allows (whole without one); every call is recorded as (name, budget, spent)."""

    def __init__(self, first: dict[str, int], cost: dict[str, int], **kw):
        super().__init__(first, **kw)
        self.left = dict(cost)
        self.calls: list[tuple[str, int | None, int]] = []

    def begin(self, seq: Sequence, budget: int | None = None) -> bool | None:
        left = self.left[seq.tenant]
        spent = left if budget is None else min(left, budget)
        self.left[seq.tenant] = left - spent
        seq.prefill_spent = spent
        self.calls.append((seq.tenant, budget, spent))
        if self.left[seq.tenant]:
            return None
        return super().begin(seq, budget)


class CountingDecode:
    """A batched decode step without a model: each sequence's next token is the one it was fed
    plus one; a fed token in `poisoned` gets a row of NaN (that sequence's logits broke). The
    step numbered `fail_at` (from 1) raises instead (the whole step broke)."""

    def __init__(self, poisoned: frozenset[int] = frozenset(), fail_at: int | None = None):
        self.poisoned, self.fail_at = poisoned, fail_at
        self.batches: list[list[int]] = []

    def __call__(self, kvs: list, tokens: list[int]) -> torch.Tensor:
        assert len(kvs) == len(tokens) and all(isinstance(kv, FakeKV) for kv in kvs)
        self.batches.append(list(tokens))
        if len(self.batches) == self.fail_at:
            raise RuntimeError("device lost")
        for kv in kvs:
            kv.length += 1  # the fed token's row
        return torch.stack([torch.full((VOCAB,), float("nan")) if t in self.poisoned else one_hot(t + 1)
                            for t in tokens])


def sequence(name: str, max_tokens: int = 3, prompt_tokens: int = 4) -> Sequence:
    return Sequence(SamplingParams(max_tokens=max_tokens), parse_policy("full"), name, None, None,
                    prompt_tokens=prompt_tokens, t0=0.0)


def submit_while_first_prefills(scheduler: Scheduler, steps: FakeSteps, first: Sequence, later: list[Sequence]) -> None:
    """`first` (gated in `steps`) is submitted and its prefill entered; `later` arrive while it
    is in progress (so they wait for the next step); then the gate opens."""
    scheduler.submit(first)
    assert steps.entered.wait(WAIT_S)
    for seq in later:
        scheduler.submit(seq)
    steps.gate.set()


def outcome(seq: Sequence) -> tuple[list[str], GenerationResult | BaseException]:
    """The text deltas a sequence emitted, then its result or the error it ended with (the
    queue's timeout raises queue.Empty if the scheduler never says)."""
    deltas: list[str] = []
    while True:
        item = seq.outbox.get(timeout=WAIT_S)
        if isinstance(item, GenerationResult | BaseException):
            return deltas, item
        deltas.append(item)


def result(seq: Sequence) -> GenerationResult:
    got = outcome(seq)[1]
    assert isinstance(got, GenerationResult), got
    return got


def error(seq: Sequence) -> BaseException:
    got = outcome(seq)[1]
    assert isinstance(got, BaseException), got
    return got


@pytest.fixture
def make_scheduler() -> Iterator:
    made: list[Scheduler] = []

    def make(steps: FakeSteps, decode: CountingDecode, max_batch: int = 4, kv_budget: int = 1000,
             prefill_budget: int = 8192, num_layers: int = 1) -> Scheduler:
        scheduler = Scheduler(decode, threading.RLock(), steps, max_batch, kv_budget,
                              prefill_budget_tokens=prefill_budget, num_layers=num_layers)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.close()


def test_requests_are_admitted_in_arrival_order_and_decoded_together(make_scheduler):
    """Three requests arrive while the first one's prefill is in progress: that step decodes the
    first alone, the next prefills the three, oldest first, and decodes all four together; each
    gets its own tokens."""
    names = ["a", "b", "c", "d"]
    steps = FakeSteps({"a": 10, "b": 20, "c": 30, "d": 40}, gated=frozenset({"a"}))
    decode = CountingDecode()
    scheduler = make_scheduler(steps, decode)
    seqs = [sequence(n) for n in names]
    submit_while_first_prefills(scheduler, steps, seqs[0], seqs[1:])
    results = [outcome(seq) for seq in seqs]
    assert steps.begun == names
    for (deltas, got), first in zip(results, (10, 20, 30, 40), strict=True):
        assert isinstance(got, GenerationResult)
        assert got.token_ids == [first, first + 1, first + 2]
        assert got.finish_reason == "length"
        assert deltas == [f"<{first}>", f"<{first + 1}>", f"<{first + 2}>"]
        assert got.text == "".join(deltas)
    assert steps.completed == names
    assert decode.batches == [[10], [11, 20, 30, 40], [21, 31, 41]]  # the tokens each step fed back
    assert (scheduler.steps_prefill, scheduler.steps_decode, scheduler.peak_batch) == (4, 3, 4)
    scheduler.close()  # the last step clears the running set after posting the results
    assert scheduler.running == 0 and scheduler.waiting == 0 and scheduler.failure is None


def test_kv_rows_count_what_the_running_sequences_hold_and_their_peaks(make_scheduler):
    """Each sequence reserves 4 + 3 + 1 rows and writes its 4 prompt rows, then one per decode
    step. The most held at once: a's 6 rows beside b's and c's 5 after the second decode step
    (24 reserved); when all have finished nothing is held, and a reset starts the peaks there."""
    steps = FakeSteps({"a": 10, "b": 20, "c": 30}, gated=frozenset({"a"}))
    decode = CountingDecode()
    scheduler = make_scheduler(steps, decode)
    seqs = [sequence(n) for n in "abc"]
    submit_while_first_prefills(scheduler, steps, seqs[0], seqs[1:])
    assert [result(seq).token_ids for seq in seqs] == [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    assert decode.batches == [[10], [11, 20, 30], [21, 31]]
    scheduler.close()  # the step that posted the last results has ended
    rows = scheduler.kv_rows
    assert (rows.peak_reserved, rows.peak_used) == (24, 16)
    assert (rows.reserved, rows.used) == (0, 0)
    scheduler.reset_kv_peaks()
    assert (scheduler.kv_rows.peak_reserved, scheduler.kv_rows.peak_used) == (0, 0)


def test_a_burst_of_arrivals_is_prefilled_within_the_budget_between_decode_steps(make_scheduler):
    """Four requests of 4 prompt tokens arrive together while a long answer streams; with a
    budget of 10 prompt tokens a step prefills two of them, and the stream (z) gets a token
    after each step's prefills instead of waiting for all four."""
    steps = FakeSteps({"z": 50, "a": 10, "b": 20, "c": 30, "d": 40}, gated=frozenset({"z"}))
    decode = CountingDecode()
    scheduler = make_scheduler(steps, decode, max_batch=8, prefill_budget=10)
    z = sequence("z", max_tokens=10)
    burst = [sequence(n) for n in "abcd"]
    submit_while_first_prefills(scheduler, steps, z, burst)
    assert result(z).token_ids == list(range(50, 60))
    assert [result(seq).token_ids for seq in burst] == [[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]]
    assert decode.batches[:4] == [[50], [51, 10, 20], [52, 11, 21, 30, 40], [53, 31, 41]]
    assert steps.begun == ["z", "a", "b", "c", "d"]


def test_a_prompt_longer_than_the_budget_is_prefilled_alone_in_its_step(make_scheduler):
    """The budget never starves a long prompt: the first waiting request is always taken, and
    nothing else joins it in that step."""
    steps = FakeSteps({"z": 50, "a": 10, "b": 20}, gated=frozenset({"z"}))
    decode = CountingDecode()
    scheduler = make_scheduler(steps, decode, prefill_budget=3)
    z, a, b = sequence("z", max_tokens=6), sequence("a", prompt_tokens=50), sequence("b", prompt_tokens=50)
    submit_while_first_prefills(scheduler, steps, z, [a, b])
    assert [result(seq).token_ids for seq in (z, a, b)] == [list(range(50, 56)), [10, 11, 12], [20, 21, 22]]
    assert decode.batches[:3] == [[50], [51, 10], [52, 11, 20]]


def test_max_batch_bounds_the_running_set(make_scheduler):
    """With room for two, the third request waits until one of the first two finished."""
    steps = FakeSteps({"a": 10, "b": 20, "c": 30}, gated=frozenset({"a"}))
    decode = CountingDecode()
    scheduler = make_scheduler(steps, decode, max_batch=2)
    seqs = [sequence(n) for n in "abc"]
    submit_while_first_prefills(scheduler, steps, seqs[0], seqs[1:])
    assert [result(seq).token_ids for seq in seqs] == [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    assert decode.batches == [[10], [11, 20], [21, 30], [31]]
    assert steps.begun == ["a", "b", "c"] and scheduler.peak_batch == 2


def test_the_kv_budget_admits_a_large_request_only_alone(make_scheduler):
    """A request whose reserved rows do not fit beside the running ones waits for them to end;
    a request larger than the whole budget still runs, alone."""
    steps = FakeSteps({"a": 10, "b": 20}, gated=frozenset({"a"}))
    decode = CountingDecode()
    scheduler = make_scheduler(steps, decode, kv_budget=10)  # a reserves 4 + 2 + 1 rows, b 4 + 9 + 1
    a, b = sequence("a", max_tokens=2), sequence("b", max_tokens=9)
    scheduler.submit(a)
    scheduler.submit(b)
    steps.gate.set()
    assert result(a).token_ids == [10, 11]
    assert result(b).token_ids == list(range(20, 29))
    assert decode.batches[0] == [10]  # b was not admitted beside a
    assert scheduler.peak_batch == 1


def test_a_failing_prefill_fails_only_its_request_and_serving_goes_on(make_scheduler):
    steps = FakeSteps({"a": 10, "b": 20, "c": 30, "d": 40}, gated=frozenset({"a"}), fail_begin=frozenset({"b"}))
    scheduler = make_scheduler(steps, CountingDecode())
    a, b, c = (sequence(n) for n in "abc")
    for seq in (a, b, c):
        scheduler.submit(seq)
    steps.gate.set()
    deltas, got = outcome(b)
    assert deltas == [] and isinstance(got, ValueError) and str(got) == "bad prompt b"
    assert result(a).token_ids == [10, 11, 12]
    assert result(c).token_ids == [30, 31, 32]
    assert "b" not in steps.completed and scheduler.failure is None
    d = sequence("d")  # the stepping thread still serves new requests
    scheduler.submit(d)
    assert result(d).token_ids == [40, 41, 42]


def test_a_failing_completion_fails_only_its_request(make_scheduler):
    """An error after the last token (keeping its conversation) reaches that request, after the
    text it already streamed; the request beside it completes."""
    steps = FakeSteps({"a": 10, "b": 20}, gated=frozenset({"a"}), fail_complete=frozenset({"b"}))
    scheduler = make_scheduler(steps, CountingDecode())
    a, b = sequence("a", max_tokens=2), sequence("b", max_tokens=2)
    scheduler.submit(a)
    scheduler.submit(b)
    steps.gate.set()
    deltas, got = outcome(b)
    assert deltas == ["<20>", "<21>"]
    assert isinstance(got, OSError) and "b's conversation" in str(got)
    assert result(a).token_ids == [10, 11]
    scheduler.close()  # the step that failed b lets go of b's KV after posting the error
    assert b.kv is None and scheduler.failure is None


def test_non_finite_logits_fail_only_their_sequence(make_scheduler):
    """One sequence's broken logits in a batched step fail that sequence; the others keep
    decoding in the next steps."""
    steps = FakeSteps({"a": 10, "b": 20, "c": 30}, gated=frozenset({"a"}))
    decode = CountingDecode(poisoned=frozenset({21}))
    scheduler = make_scheduler(steps, decode)
    a, b, c = (sequence(n) for n in "abc")
    submit_while_first_prefills(scheduler, steps, a, [b, c])
    deltas, got = outcome(b)
    assert deltas == ["<20>", "<21>"] and isinstance(got, NonFiniteLogitsError)
    assert result(a).token_ids == [10, 11, 12]
    assert result(c).token_ids == [30, 31, 32]
    assert decode.batches == [[10], [11, 20, 30], [21, 31]]


def test_a_failing_decode_step_fails_its_batch_and_serving_goes_on(make_scheduler):
    steps = FakeSteps({"a": 10, "b": 20, "c": 30}, gated=frozenset({"a"}))
    decode = CountingDecode(fail_at=2)  # a's first decode step alone, then a's and b's together
    scheduler = make_scheduler(steps, decode)
    a, b = sequence("a"), sequence("b")
    submit_while_first_prefills(scheduler, steps, a, [b])
    got_a, got_b = error(a), error(b)
    assert got_a is got_b and isinstance(got_a, RuntimeError) and str(got_a) == "device lost"
    assert a.kv is None and b.kv is None
    c = sequence("c")
    scheduler.submit(c)
    assert result(c).token_ids == [30, 31, 32]
    assert scheduler.failure is None


def test_stop_ends_the_thread_and_fails_what_is_left(make_scheduler):
    """`stop` while a prefill is in progress: that step (the prefill and its decode step)
    finishes, then the running and the waiting request both end with SchedulerClosed, new
    requests are refused, and `close` returns with the stepping thread gone."""
    steps = FakeSteps({"a": 10, "b": 20}, gated=frozenset({"a"}))
    scheduler = make_scheduler(steps, CountingDecode())
    a, b = sequence("a"), sequence("b")
    scheduler.submit(a)
    assert steps.entered.wait(WAIT_S)
    scheduler.submit(b)
    scheduler.stop()
    with pytest.raises(SchedulerClosed, match="closed"):
        scheduler.submit(sequence("c"))
    steps.gate.set()
    scheduler.close()
    deltas, got = outcome(a)
    assert deltas == ["<10>", "<11>"] and isinstance(got, SchedulerClosed)
    assert isinstance(error(b), SchedulerClosed)
    assert steps.begun == ["a"]  # b never started
    assert a.kv is None
    assert steps.threads and not any(t.is_alive() for t in steps.threads)
    scheduler.close()  # a second close has nothing left to do


def test_close_of_an_idle_scheduler_ends_its_thread(make_scheduler):
    steps = FakeSteps({"a": 10})
    scheduler = make_scheduler(steps, CountingDecode())
    a = sequence("a", max_tokens=1)
    scheduler.submit(a)
    assert result(a).token_ids == [10]
    scheduler.close()
    assert steps.threads and not any(t.is_alive() for t in steps.threads)
    with pytest.raises(SchedulerClosed):
        scheduler.submit(sequence("b"))


def test_a_fault_outside_any_sequence_stops_the_loop_for_everyone(make_scheduler, caplog):
    """Engine state breaking (here the KV pool taking a buffer back) is no one request's error:
    the loop stops, every request left fails with SchedulerClosed, `failure` says why and new
    requests are refused."""
    def broken_pool(kv: object) -> None:
        raise RuntimeError("pool broken")

    steps = FakeSteps({"a": 10, "b": 20}, gated=frozenset({"a"}), on_release=broken_pool)
    scheduler = make_scheduler(steps, CountingDecode())
    a, b = sequence("a", max_tokens=1), sequence("b")
    submit_while_first_prefills(scheduler, steps, a, [b])
    assert result(a).token_ids == [10]  # posted before its buffer went back
    got = error(b)
    assert isinstance(got, SchedulerClosed) and "pool broken" in str(got)
    scheduler.close()
    assert scheduler.failure == "RuntimeError: pool broken"
    assert steps.begun == ["a"]
    assert not any(t.is_alive() for t in steps.threads)
    with pytest.raises(SchedulerClosed, match="stopped on a fault"):
        scheduler.submit(sequence("c"))


def test_a_fault_fails_the_requests_admitted_to_the_step_but_not_yet_prefilled(make_scheduler):
    """a and b are admitted to one step; a's prefill breaks engine state (its KV cannot go back
    to the pool): b, admitted but never begun, and z, running, end with SchedulerClosed."""
    def pool_broken_for_a(kv: FakeKV) -> None:
        if kv.owner == "a":
            raise RuntimeError("pool broken")

    steps = FakeSteps({"z": 50, "a": 10, "b": 20}, gated=frozenset({"z"}), on_release=pool_broken_for_a)
    scheduler = make_scheduler(steps, CountingDecode())
    z, a, b = sequence("z", max_tokens=8), sequence("a", max_tokens=1), sequence("b")
    submit_while_first_prefills(scheduler, steps, z, [a, b])
    assert result(a).token_ids == [10]
    for seq in (b, z):
        got = error(seq)
        assert isinstance(got, SchedulerClosed) and "pool broken" in str(got)
    scheduler.close()
    assert steps.begun == ["z", "a"] and scheduler.failure == "RuntimeError: pool broken"


def test_a_long_prefill_pauses_for_the_running_sequences_decode_steps(make_scheduler):
    """Budget 10 tokens x 2 layers = 20 token-layers a step while a sequence decodes: b's prefill
    of 50 runs over three steps, a decodes a token after each part, and b joins the batch after
    its last part. a's own prefill ran whole (nothing was decoding then)."""
    steps = LayeredSteps({"a": 10, "b": 20}, {"a": 35, "b": 50}, gated=frozenset({"a"}))
    decode = CountingDecode()
    scheduler = make_scheduler(steps, decode, prefill_budget=10, num_layers=2)
    a, b = sequence("a", max_tokens=8), sequence("b", max_tokens=3)
    submit_while_first_prefills(scheduler, steps, a, [b])
    assert result(a).token_ids == list(range(10, 18)) and result(b).token_ids == [20, 21, 22]
    assert steps.calls == [("a", None, 35), ("b", 20, 20), ("b", 20, 20), ("b", 20, 10)]
    assert decode.batches[:6] == [[10], [11], [12], [13, 20], [14, 21], [15]]
    assert scheduler.prefill_splits == 2


def test_prefills_finish_in_arrival_order_when_one_is_split(make_scheduler):
    """b and c are admitted together; b's prefill is split over steps and c's starts only after
    b's last part, so prefills finish in arrival order."""
    steps = LayeredSteps({"a": 10, "b": 20, "c": 30}, {"a": 1, "b": 50, "c": 1}, gated=frozenset({"a"}))
    decode = CountingDecode()
    scheduler = make_scheduler(steps, decode, prefill_budget=10, num_layers=2)
    a, b, c = sequence("a", max_tokens=8), sequence("b"), sequence("c")
    submit_while_first_prefills(scheduler, steps, a, [b, c])
    assert [result(s).token_ids[0] for s in (a, b, c)] == [10, 20, 30]
    order = [name for name, _, _ in steps.calls]
    assert order == ["a", "b", "b", "b", "c"]
