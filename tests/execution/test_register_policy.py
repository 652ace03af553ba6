"""Adding a policy: one module's worth of class plus one `register_policy` line, here a policy
written in this test (the last k tokens of each fused chunk recomputed, EPIC's mirror image).
Once registered, the engine, the grammar and its error messages take it like a built-in one;
once removed, it is unknown again."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.policies import (
    Policy,
    PrefillView,
    Selection,
    parse_policy,
    register_policy,
    span_masks,
)
from ragcache_integrations import ChunkedPrompt
from ragcache_integrations.policy_registry import PolicyEntry, PolicySpec, check_policy, forms_text

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
]


@dataclass(frozen=True)
class TailPolicy(Policy):
    """The last k tokens of each fused chunk recomputed from layer 0."""

    name = "tail"
    k: int = 4

    @classmethod
    def from_spec(cls, spec: PolicySpec) -> TailPolicy:
        return cls(int(spec.value or 0))

    def select(self, view: PrefillView) -> Selection:
        active = span_masks(view.plan)[1]
        for span in view.plan.spans:
            if span.mode == "fuse":
                active[max(span.start, span.end - self.k) : span.end] = True
        return Selection(active, fixed=True)


@pytest.fixture
def tail_registered() -> Iterator[None]:
    unregister = register_policy(PolicyEntry("tail", "the last k tokens of each fused chunk", arg="k", default=4),
                                 TailPolicy)
    yield
    unregister()


def test_a_registered_policy_parses_and_is_refused_like_a_built_in_one(tail_registered):
    policy = parse_policy("tail:6")
    assert isinstance(policy, TailPolicy) and policy.k == 6
    assert parse_policy("tail").k == 4 and parse_policy("tail:6:temp1.2").temperature == 1.2
    assert "tail[:k]" in forms_text() and check_policy("tail:3") == "tail:3"
    with pytest.raises(InvalidPromptError, match=r"k must be a whole number.*form: tail\[:k\]"):
        parse_policy("tail:0.5")


def test_a_removed_policy_is_unknown_again():
    unregister = register_policy(PolicyEntry("tail", "the last k tokens", arg="k", default=4), TailPolicy)
    unregister()
    with pytest.raises(InvalidPromptError, match="unknown policy 'tail:3'"):
        parse_policy("tail:3")
    assert "tail" not in forms_text()


def test_registering_a_taken_name_or_a_mismatched_class_is_refused(tail_registered):
    with pytest.raises(ValueError, match="already registered"):
        register_policy(PolicyEntry("tail", "again", arg="k", default=4), TailPolicy)
    with pytest.raises(ValueError, match="already"):
        register_policy(PolicyEntry("epic", "a second epic", arg="k", default=4), type("Epic2", (TailPolicy,),
                                                                                        {"name": "epic"}))
    with pytest.raises(ValueError, match="differs"):
        register_policy(PolicyEntry("head", "mismatch", arg="k", default=4), TailPolicy)
    # a subclass left undecorated could take per-request state in its own __init__
    with pytest.raises(ValueError, match="frozen"):
        register_policy(PolicyEntry("tail2", "undecorated", arg="k", default=4), type("Tail2", (TailPolicy,),
                                                                                      {"name": "tail2"}))


def test_the_engine_runs_a_registered_policy(tail_registered, tiny_engine):
    """Through the real engine: tail recomputes k tokens per fused chunk (the stats count them),
    tail:0 is reuse and a tail longer than every chunk is full prefill."""
    prompt = ChunkedPrompt(chunks=PASSAGES, question="Which river reaches the Atlantic?")
    full, _ = tiny_engine.prefill_logits(prompt, policy="full")
    tiny_engine.warm(PASSAGES)
    reuse, _ = tiny_engine.prefill_logits(prompt, policy="reuse")
    tail, stats = tiny_engine.prefill_logits(prompt, policy="tail:3")
    fused = [s for s in stats.plan if s["mode"] == "fuse"]
    assert stats.chunk_hits == 2 and len(fused) == 2 and stats.tokens_recomputed == 3 * len(fused)
    zero, _ = tiny_engine.prefill_logits(prompt, policy="tail:0")
    assert torch.equal(zero, reuse)
    whole, _ = tiny_engine.prefill_logits(prompt, policy="tail:4096")
    assert (whole - full).abs().max().item() <= 1e-4
    assert not torch.allclose(tail, reuse)
