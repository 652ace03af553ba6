"""Planning decides, the engine keeps: a prefill that raises leaves the store, the CP-Tree, the
Cache-Craft variants and the conversations as they were; the same request succeeding changes
them (so the check can fail)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import pytest

from engine_sidecar import Engine
from engine_sidecar.execution.policies import LayerView, PrefillView, PrefixPolicy, Selection
from ragcache_integrations import ChunkedPrompt

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes through ten countries, more than any other river in the world.",
]


def _fail_at_layer_one(view: LayerView) -> None:
    if view.layer == 1:
        raise RuntimeError("prefill failed on purpose")


@dataclass(frozen=True)
class FailsMidPrefill(PrefixPolicy):
    """Exact-prefix reuse whose prefill raises at layer 1, after layer 0 wrote the KV buffer."""

    def select(self, view: PrefillView) -> Selection:
        return dataclasses.replace(super().select(view), refine=_fail_at_layer_one)


def _state(engine: Engine) -> tuple:
    stats = engine.cache.store.stats()
    return (stats.ram_entries, stats.disk_entries, engine.cache.cptree.nodes(), engine.cache.cptree.roots(),
            len(engine.cache.conversations), len(engine.cache.variants))


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


def test_the_first_token_is_out_before_the_commit(engine):
    """Keeping what a prefill computed is off the time to first token: the caller holds the first
    token while the commit runs (a commit before it would wait here until its deadline)."""
    first_token_seen = threading.Event()
    seen_at_commit: list[bool] = []
    commit = engine.cache.writer.commit

    def commit_after_the_caller_has_its_token(planned, result, tenant):
        seen_at_commit.append(first_token_seen.wait(timeout=20))
        commit(planned, result, tenant)

    engine.cache.writer.commit = commit_after_the_caller_has_its_token
    stream = engine.stream(ChunkedPrompt(chunks=PASSAGES, question="Which river is longest?"),
                           {"max_tokens": 3, "temperature": 0, "ignore_eos": True}, policy="cacheblend")
    ticks = stream.ticks()
    next(ticks)
    first_token_seen.set()
    for _ in ticks:
        pass
    assert seen_at_commit == [True]
    assert stream.result is not None and stream.result.stats.stage_times["commit_s"] >= 0
    # and what it computed was kept: the misses now hit
    again = engine.generate(ChunkedPrompt(chunks=PASSAGES, question="Which river is longest?"),
                            {"max_tokens": 1}, policy="cacheblend")
    assert again.stats.chunk_hits == len(PASSAGES)


def _reads_in(engine: Engine, monkeypatch) -> list[str]:
    """The values `engine.cache.writer.commit` reads back from tensors (a host sync each on a GPU)."""
    import torch

    reads: list[str] = []
    inside = threading.local()
    for name in ("__bool__", "__int__", "__float__", "item", "tolist", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if getattr(inside, "on", False):
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    commit = engine.cache.writer.commit

    def counted_commit(planned, result, tenant):
        inside.on = True
        try:
            commit(planned, result, tenant)
        finally:
            inside.on = False

    monkeypatch.setattr(engine.cache.writer, "commit", counted_commit)
    return reads


def test_a_commit_checks_every_entry_in_one_read(engine, monkeypatch):
    """The template prefix and three misses computed in place are four entries: their KV is checked
    finite together, one read, not one per entry."""
    engine.clear_cache()
    before = engine.cache.store.stats().ram_entries
    reads = _reads_in(engine, monkeypatch)
    engine.generate(ChunkedPrompt(chunks=PASSAGES, question="Which river is longest?"), {"max_tokens": 1},
                    policy="cacheblend")
    assert engine.cache.store.stats().ram_entries - before >= 4
    assert reads == ["__bool__"]


def test_a_poisoned_entry_stores_none_of_the_requests_entries(engine, monkeypatch):
    """One span's KV holding NaN refuses the whole commit before anything is stored: no entry of
    the request lands beside the poisoned one."""
    import torch

    from engine_sidecar.errors import NonFiniteKVError

    engine.clear_cache()
    prompt, _, policy = engine.prep.prepare(ChunkedPrompt(chunks=PASSAGES, question="Which river is longest?"),
                                            None, "cacheblend", "preserve", "")
    planned = engine.cache.plan(prompt, policy, "")
    planned, result = engine.prefill_stage.run(planned, planned.plan.num_tokens + 1, {})
    assert len(planned.in_place) == 3
    last = planned.plan.spans[planned.in_place[-1][0]]  # the last passage computed in place
    with torch.inference_mode():  # the buffer is an inference tensor, as the prefill made it
        result.kv.values[:, last.start] = float("nan")
    before = engine.cache.store.stats()
    with pytest.raises(NonFiniteKVError):
        engine.cache.writer.commit(planned, result, "")
    engine.cache.store.flush()
    after = engine.cache.store.stats()
    assert (after.ram_entries, after.disk_entries) == (before.ram_entries, before.disk_entries)
    assert engine.cache.store.refused_non_finite == 1
