"""Property tests for the planner over an in-memory reuse state (no Engine, no model): every
prompt token is planned exactly once and in order, tenants never share an entry, and a
conversation's dedup never drops a passage whose text differs from the ones it holds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_sidecar.execution.policies import parse_policy
from engine_sidecar.request.prompt import PromptBuilder, segment_digest
from engine_sidecar.reuse.conversation import Conversation
from engine_sidecar.reuse.planner import IN_CONTEXT, Planner
from engine_sidecar.store.entry import ChunkKV
from ragcache_integrations import Chunk, ChunkedPrompt
from tests.reuse.test_planner_unit import MemoryState

WORDS = ["river", "mountain", "Danube", "Amazon", "lake", "ocean", "Africa", "flows", "highest", "the"]
texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
chunk_lists = st.lists(st.tuples(st.sampled_from("abcdef"), texts), min_size=0, max_size=5)
policies = st.sampled_from(["full", "prefix", "reuse", "cacheblend:0.3", "epic:2"])
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def builder(tiny_llama_dir) -> PromptBuilder:
    return PromptBuilder.load(tiny_llama_dir)


def _prompt(chunks: list[tuple[str, str]], question: str, conversation_id: str | None = None) -> ChunkedPrompt:
    return ChunkedPrompt(chunks=[Chunk(id=i, text=t) for i, t in chunks], question=question,
                         conversation_id=conversation_id)


def _store_some(state: MemoryState, prompt: ChunkedPrompt, held: list[bool], tenant: str) -> None:
    for seg, keep in zip((s for s in state.builder.build(prompt).segments if s.kind == "chunk"), held, strict=False):
        if keep:
            state.store.put(state.keys.for_tokens(seg.token_ids, tenant, IN_CONTEXT), state.entry(seg.token_ids, tenant))


@SETTINGS
@given(chunks=chunk_lists, question=texts, policy=policies, held=st.lists(st.booleans(), max_size=5))
def test_every_prompt_token_is_planned_exactly_once_in_order(builder, chunks, question, policy, held):
    state = MemoryState(builder)
    prompt = _prompt(chunks, question)
    _store_some(state, prompt, held, "")
    planned = Planner(state).plan(prompt, parse_policy(policy), "", use_prefix_tree=True, dedup=True)
    spans = planned.plan.spans
    assert [s.start for s in spans] == [sum(len(p.token_ids) for p in spans[:i]) for i in range(len(spans))]
    assert list(planned.plan.token_ids) == list(builder.build(prompt).token_ids)
    for span in spans:
        if span.cached is not None:
            assert torch.equal(span.cached.token_ids, torch.tensor(span.token_ids))  # KV of these very tokens


@SETTINGS
@given(chunks=chunk_lists, question=texts, held=st.lists(st.booleans(), max_size=5))
def test_one_tenants_entries_never_serve_another(builder, chunks, question, held):
    state = MemoryState(builder)
    prompt = _prompt(chunks, question)
    _store_some(state, prompt, held, "tenant-a")
    planned = Planner(state).plan(prompt, parse_policy("cacheblend"), "tenant-b", use_prefix_tree=True, dedup=True)
    assert planned.hits == 0 and all(s.cached is None for s in planned.plan.spans)


@SETTINGS
@given(first=chunk_lists, second=chunk_lists, question=texts)
def test_dedup_drops_only_passages_the_conversation_holds(builder, first, second, question):
    state = MemoryState(builder)
    earlier = _prompt(first, question, "c")
    held = {segment_digest(s) for s in builder.build(earlier).segments if s.kind == "chunk"}
    history = builder.build(earlier).token_ids
    n = len(history)
    state.conversations.put(Conversation("", "c", earlier.system,
                                         ChunkKV(torch.zeros(2, n, 1, 4), torch.zeros(2, n, 1, 4),
                                                 torch.tensor(history), None, ""), held))
    turn = _prompt(second, question, "c")
    planned = Planner(state).plan(turn, parse_policy("cacheblend"), "", use_prefix_tree=True, dedup=True)
    planned_chunks = [s for s in planned.plan.spans if s.kind == "chunk"]
    for seg in (s for s in builder.build(turn).segments if s.kind == "chunk"):
        kept = any(s.token_ids == seg.token_ids for s in planned_chunks)
        # a passage the conversation does not hold (by text) is always planned; one it holds never
        assert kept == (segment_digest(seg) not in held)
