"""A layer where the policy drops rows reads back from the device once (the next layer's row
count), then takes the rows by index: a boolean mask read its count back once per tensor taken,
and on a GPU every such read is a sync. Counted as the `aten::nonzero` calls of one prefill."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from ragcache_integrations import ChunkedPrompt

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]


def _count_nonzero(engine, policy: str) -> int:
    prompt = ChunkedPrompt(chunks=PASSAGES[::-1], question="Which river reaches the Atlantic?")
    engine.prefill_logits(prompt, policy=policy)  # first-call work off the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits, _ = engine.prefill_logits(prompt, policy=policy)
    assert torch.isfinite(logits).all()
    return sum(event.name == "aten::nonzero" for event in prof.events())


def test_each_shrinking_layer_reads_back_once(tiny_engine):
    """`cacheblend:r` shrinks on its check layer (1); `cacheblend:r:gradual` on the check layer and
    each layer after it up to the last (3r, 2r, then r; pulled in on a shallow model): as many reads
    apart as it has shrinking layers more."""
    tiny_engine.warm(PASSAGES)
    layers = tiny_engine.runner.num_layers
    gradual_layers = min(3, max(1, layers - 1))  # layers 1 .. min(3, L - 1)
    assert gradual_layers >= 2
    one = _count_nonzero(tiny_engine, "cacheblend:0.3")
    gradual = _count_nonzero(tiny_engine, "cacheblend:0.3:gradual")
    assert gradual - one == gradual_layers - 1, (one, gradual)


def test_a_layer_that_keeps_every_row_takes_none(tiny_engine):
    """At ratio 1 the check layer keeps every row: the prefill equals full prefill."""
    tiny_engine.warm(PASSAGES)
    prompt = ChunkedPrompt(chunks=PASSAGES[::-1], question="Which river reaches the Atlantic?")
    full, _ = tiny_engine.prefill_logits(prompt, policy="full")
    blend, stats = tiny_engine.prefill_logits(prompt, policy="cacheblend:1.0")
    assert stats.chunk_hits == 3 and (full - blend).abs().max().item() <= 1e-4
