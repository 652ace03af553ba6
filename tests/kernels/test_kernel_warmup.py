"""The start-up warm-up launches every Triton kernel variant that requests then launch, so on a GPU
no request pays a compile (the kernels forced through Triton's CPU interpreter; a variant is a
kernel and its compile-time constants)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from ragcache_integrations import ChunkedPrompt  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean, carrying more water "
    "than any other river on Earth.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres above sea level.",
    "The Danube rises in the Black Forest and flows through ten countries before reaching the Black Sea.",
]


@contextlib.contextmanager
def launched_variants() -> Iterator[set[tuple[str, tuple]]]:
    """Collects (kernel, its compile-time constants) for every launch while open."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[tuple[str, tuple]] = set()
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        constants = tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper()))
        seen.add((self.fn.__name__, constants))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    try:
        yield seen
    finally:
        InterpretedFunction.run = run


@pytest.fixture(scope="module")
def tiny64(smol_dir, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny64w"), "llama", tokenizer_from=smol_dir,
                           hidden_size=192, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=2)


def test_the_warm_up_launches_every_variant_that_requests_launch(tiny64, monkeypatch):
    from engine_sidecar import Engine
    from engine_sidecar.execution.kernel_warmup import warm_kernels

    monkeypatch.setenv("RAGCACHE_KERNELS", "triton")
    with Engine.from_pretrained(tiny64, device="cpu", dtype="float32", disk=False, prefix_tree=False) as engine:
        # sizes the interpreter splits keys at (it pretends to 4 multiprocessors), as 1,024 and 64
        # tokens do on a GPU
        with launched_variants() as warmed:
            seconds = warm_kernels(engine.runner, long_tokens=160, short_tokens=24)
        assert seconds > 0
        names = {name for name, _ in warmed}
        assert {"_selective_attention_kernel", "merge_splits_kernel", "_append_rows_kernel",
                "_decode_attention_kernel"} <= names
        # both sides of each split decision were launched
        for kernel in ("_selective_attention_kernel", "_decode_attention_kernel"):
            assert {dict(c)["SPLIT"] for n, c in warmed if n == kernel} == {False, True}

        engine.warm(PASSAGES)
        sampling = {"max_tokens": 6, "ignore_eos": True}
        with launched_variants() as requested:
            for policy in ("full", "reuse", "cacheblend", "cacheblend:0.3", "epic:4"):
                engine.generate(ChunkedPrompt(chunks=PASSAGES[::-1], question=f"Which river? ({policy})"),
                                sampling, policy=policy)
            # two at once: decode batches of two sequences of different lengths
            answers = [threading.Thread(target=engine.generate, args=(
                ChunkedPrompt(chunks=PASSAGES[:k], question="Where is it?"), sampling)) for k in (1, 3)]
            for thread in answers:
                thread.start()
            for thread in answers:
                thread.join()
    assert requested, "the requests launched no Triton kernel"
    assert requested <= warmed, sorted(requested - warmed)


def test_the_warm_up_leaves_no_cache_entry_behind(tiny64):
    from engine_sidecar import Engine
    from engine_sidecar.execution.kernel_warmup import warm_kernels

    with Engine.from_pretrained(tiny64, device="cpu", dtype="float32", disk=False) as engine:
        before = len(engine.cache.store.ram)
        warm_kernels(engine.runner, long_tokens=64, short_tokens=16)
        assert len(engine.cache.store.ram) == before == 0
        # the runner still answers as before: the warm-up wrote into buffers of its own
        first, _ = engine.prefill_logits(ChunkedPrompt(chunks=PASSAGES[:1], question="Where?"), policy="full")
        assert torch.isfinite(first).all()
