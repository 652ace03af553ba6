"""Where a prefill's time goes, in the request's stats on a CPU: the stages present are the ones
the policy runs (dense layers for CacheBlend's full layers, none under reuse, only dense under
full), and together they account for the prefill."""

from __future__ import annotations

import pytest

from ragcache_integrations import ChunkedPrompt

# passages long beside the question and the template, as a RAG prompt's are
PASSAGES = [
    " ".join(["The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean."] * 4),
    " ".join(["Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres."] * 4),
    " ".join(["The Danube river flows through ten countries into the Black Sea."] * 4),
]
STAGES = ("prefill_setup_s", "prefill_rotate_s", "prefill_probe_s", "prefill_dense_layers_s",
          "prefill_sparse_layers_s", "prefill_logits_s")


def stage_times(engine, policy: str) -> dict[str, float]:
    result = engine.generate(ChunkedPrompt(chunks=PASSAGES[::-1], question="Which river reaches the Atlantic?"),
                             {"max_tokens": 1}, policy=policy)
    return result.stats.stage_times


@pytest.mark.parametrize("policy,dense,sparse", [("cacheblend:0.15", True, True), ("reuse", False, True),
                                                 ("full", True, False), ("prophet:0.15", False, True)])
def test_the_stages_a_policy_runs_are_timed_and_add_up_to_the_prefill(tiny_engine, policy, dense, sparse):
    tiny_engine.warm(PASSAGES)
    stage_times(tiny_engine, "reuse")  # the template prefix computed and kept, as in a running sidecar
    times = stage_times(tiny_engine, policy)
    assert ("prefill_dense_layers_s" in times) == dense
    assert ("prefill_sparse_layers_s" in times) == sparse
    parts = {k: v for k, v in times.items() if k in STAGES}
    assert {"prefill_setup_s", "prefill_logits_s"} <= set(parts) and all(v >= 0 for v in parts.values())
    # the stages partition the prefill: together no longer than it, and most of it
    total = sum(parts.values())
    assert total <= times["prefill_s"] and total >= 0.5 * times["prefill_s"]
