"""A decode step chooses every sequence's next token on the device and reads them back together:
one host sync per step (on a GPU each read is one), whatever the batch size; a row's fault stays
that row's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine_sidecar import Engine
from engine_sidecar.engine.sampling import choose_token, choose_tokens
from engine_sidecar.errors import NonFiniteLogitsError
from ragcache_integrations.types import ChunkedPrompt, SamplingParams

READS = ("__bool__", "__int__", "__float__", "item", "tolist", "cpu", "numpy")
GREEDY, WARM = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)


def _count_reads(monkeypatch, only_while=None) -> list[str]:
    """Every value read back from a tensor (a host sync on a GPU), on this thread, or while
    `only_while()` is true."""
    reads: list[str] = []
    caller = threading.get_ident()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if (only_while() if only_while is not None else threading.get_ident() == caller):
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_greedy_rows_are_each_rows_argmax():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    assert choose_tokens(logits, [GREEDY] * 5, [None] * 5) == logits.argmax(-1).tolist()


def test_a_bad_row_is_that_rows_error_and_the_others_are_chosen():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    logits[1, 7] = float("nan")
    logits[2] = 1e38  # finite, but tempered at 1e-3 it overflows
    logits[3, :] = float("-inf")
    logits[3, 9] = 2.0  # every other token masked: a sampled row must pick 9
    params = [GREEDY, WARM, SamplingParams(temperature=1e-3), WARM]
    choices = choose_tokens(logits, params, [None] * 4)
    assert choices[0] == int(logits[0].argmax()) and choices[3] == 9
    assert isinstance(choices[1], NonFiniteLogitsError) and isinstance(choices[2], NonFiniteLogitsError)
    with pytest.raises(NonFiniteLogitsError):
        choose_token(logits[1], GREEDY, None)


def test_a_seeded_row_draws_as_it_does_alone():
    logits = torch.randn(3, 80, generator=torch.Generator().manual_seed(6))
    params = [GREEDY, WARM, SamplingParams(temperature=0.8, top_p=0.9, seed=11)]
    alone = choose_token(logits[2], params[2], torch.Generator().manual_seed(11))
    together = choose_tokens(logits, params, [None, None, torch.Generator().manual_seed(11)])
    assert together[2] == alone and together[0] == int(logits[0].argmax())


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_one_read_for_the_whole_batch(monkeypatch, rows):
    logits = torch.randn(rows, 120, generator=torch.Generator().manual_seed(rows))
    params = [GREEDY if i % 2 else WARM for i in range(rows)]
    choose_tokens(logits, params, [None] * rows)  # first-call work off the count
    reads = _count_reads(monkeypatch)
    choices = choose_tokens(logits, params, [None] * rows)
    assert reads == ["tolist"] and len(choices) == rows


def test_a_decode_step_reads_back_once_whatever_its_batch(tiny_llama_dir, tmp_path, monkeypatch):
    """Through the scheduler: three sequences decoding together make one read per step, not one
    per sequence."""
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv") as engine:
        scheduler = engine.scheduler
        inside = threading.local()
        steps: list[int] = []
        decode = scheduler._decode

        def counted_decode() -> None:
            steps.append(len(scheduler._running))
            inside.on = True
            try:
                decode()
            finally:
                inside.on = False

        monkeypatch.setattr(scheduler, "_decode", counted_decode)
        submitted: list[object] = []
        submit = scheduler.submit

        def counted_submit(seq, *args, **kwargs):
            submitted.append(seq)
            return submit(seq, *args, **kwargs)

        monkeypatch.setattr(scheduler, "submit", counted_submit)
        reads = _count_reads(monkeypatch, only_while=lambda: getattr(inside, "on", False))
        prompts = [ChunkedPrompt(chunks=[f"Passage {i} about rivers and bridges."], question=f"Which river {i}?")
                   for i in range(3)]
        results: dict[int, object] = {}

        def ask(i: int) -> None:
            sampling = {"max_tokens": 8, "temperature": 0.0 if i else 0.7, "ignore_eos": True}
            results[i] = engine.generate(prompts[i], sampling)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        with scheduler.lock:  # the scheduler waits until all three are queued: they decode together
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 60
            while len(submitted) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        for thread in threads:
            thread.join(timeout=120)
    assert all(len(results[i].token_ids) == 8 for i in range(3))
    assert max(steps) > 1  # some steps decoded several sequences at once
    assert len(reads) == len(steps), (reads, steps)
