"""Planning decides, the engine keeps: a prefill that raises leaves the store, the CP-Tree, the
Cache-Craft variants and the conversations as they were; the same request succeeding changes
them (so the check can fail)."""

from __future__ import annotations

import pytest

from engine_sidecar import Engine
from engine_sidecar.policies import LayerView, PrefixPolicy
from ragcache_integrations import ChunkedPrompt

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]


class FailsMidPrefill(PrefixPolicy):
    """Exact-prefix reuse whose prefill raises at layer 1, after layer 0 wrote the KV buffer."""

    def refine(self, view: LayerView):
        if view.layer == 1:
            raise RuntimeError("prefill failed on purpose")
        return None


def _state(engine: Engine) -> tuple:
    stats = engine.store.stats()
    return (stats.ram_entries, stats.disk_entries, engine.cptree.nodes(), engine.cptree.roots(),
            len(engine.conversations), len(engine.variants))


@pytest.fixture
def engine(tiny_llama_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv")
    yield engine
    engine.close()


def test_a_failed_prefill_changes_no_reuse_state(engine):
    question = "Which river reaches the Atlantic?"
    # a first request stores nothing in the tree yet (counts below the promotion threshold) ...
    engine.generate(ChunkedPrompt(chunks=PASSAGES, question="warm-up"), {"max_tokens": 2}, policy="prefix")
    engine.clear_cache()
    before = _state(engine)
    # ... the second would promote all three chunks to CP-Tree nodes and keep its conversation
    failing = ChunkedPrompt(chunks=PASSAGES, question=question, conversation_id="c1")
    with pytest.raises(RuntimeError, match="on purpose"):
        engine.generate(failing, {"max_tokens": 2}, policy=FailsMidPrefill())
    assert _state(engine) == before
    # the same request succeeding stores the prefix, three nodes and the conversation
    engine.generate(failing, {"max_tokens": 2}, policy="prefix")
    after = _state(engine)
    assert after[2] == before[2] + 3 and after[4] == before[4] + 1 and after[0] > before[0]
