"""A layer where the policy drops rows takes them by index, and reads nothing back from the device
when the policy knows on the host how many it keeps (CacheBlend: the rows it must keep and its
budget): on a GPU every read-back is a sync, which stops the host queueing the later layers while
the device catches up. Counted as the nonzero ops of one prefill (each reads its count back)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from ragcache_integrations import ChunkedPrompt

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]
READS = ("aten::nonzero", "aten::nonzero_static")


def _count_reads(engine, policy: str) -> Counter:
    prompt = ChunkedPrompt(chunks=PASSAGES[::-1], question="Which river reaches the Atlantic?")
    engine.prefill_logits(prompt, policy=policy)  # first-call work off the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits, _ = engine.prefill_logits(prompt, policy=policy)
    assert torch.isfinite(logits).all()
    return Counter(event.name for event in prof.events() if event.name in READS)


def test_shrinking_layers_take_their_rows_without_reading_back(tiny_engine):
    """`cacheblend:r` shrinks on its check layer (1); `cacheblend:r:gradual` on the check layer and
    each layer after it up to the last (3r, 2r, then r; pulled in on a shallow model): each shrink
    takes its rows with a count known on the host, so the gradual form reads back no more than
    the one-step form, and no more than a prefill that never shrinks."""
    tiny_engine.warm(PASSAGES)
    layers = tiny_engine.runner.num_layers
    gradual_layers = min(3, max(1, layers - 1))  # layers 1 .. min(3, L - 1)
    assert gradual_layers >= 2
    never = _count_reads(tiny_engine, "reuse")
    one = _count_reads(tiny_engine, "cacheblend:0.3")
    gradual = _count_reads(tiny_engine, "cacheblend:0.3:gradual")
    assert (one["aten::nonzero_static"], gradual["aten::nonzero_static"]) == (1, gradual_layers)
    # the one nonzero left is layer 0's pick of rows, on the host
    assert one["aten::nonzero"] == gradual["aten::nonzero"] == never["aten::nonzero"], (never, one, gradual)


def test_a_layer_that_keeps_every_row_takes_none(tiny_engine):
    """At ratio 1 the check layer keeps every row: the prefill equals full prefill."""
    tiny_engine.warm(PASSAGES)
    prompt = ChunkedPrompt(chunks=PASSAGES[::-1], question="Which river reaches the Atlantic?")
    full, _ = tiny_engine.prefill_logits(prompt, policy="full")
    blend, stats = tiny_engine.prefill_logits(prompt, policy="cacheblend:1.0")
    assert stats.chunk_hits == 3 and (full - blend).abs().max().item() <= 1e-4
