"""The planner against an in-memory reuse state, without an Engine: it decides from what the
store and the indexes hold, and (with misses computed in place) computes and writes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine_sidecar.engine_config import EngineConfig
from engine_sidecar.execution.cachecraft import VariantIndex
from engine_sidecar.execution.policies import parse_policy
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.request.prompt import PromptBuilder, Segment
from engine_sidecar.request.reorder import ChunkAccessTable
from engine_sidecar.reuse.conversation import ConversationStore
from engine_sidecar.reuse.cptree import CPTree
from engine_sidecar.reuse.planner import IN_CONTEXT, Planner
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.entry import CacheKey, ChunkKV
from ragcache_integrations import Chunk, ChunkedPrompt

CHUNKS = [Chunk(id="a", text="The Amazon river flows through Brazil into the Atlantic Ocean."),
          Chunk(id="b", text="Mount Kilimanjaro in Tanzania is the highest mountain in Africa."),
          Chunk(id="c", text="The Danube passes through ten countries in Europe.")]


@dataclass
class MemoryState:
    """Everything planning reads, in memory; `precompute_chunk` must never run here."""

    builder: PromptBuilder
    keys: KeyFactory = field(default_factory=lambda: KeyFactory("model", "tokenizer", "isolated"))
    config: EngineConfig = field(default_factory=EngineConfig)
    store: ChunkStore = field(default_factory=lambda: ChunkStore(1 << 26, None, torch.device("cpu")))
    variants: VariantIndex = field(default_factory=lambda: VariantIndex(4, 64))
    conversations: ConversationStore = field(default_factory=ConversationStore)
    access_table: ChunkAccessTable = field(default_factory=lambda: ChunkAccessTable(100))
    cptree: CPTree = field(init=False)

    def __post_init__(self) -> None:
        self.cptree = CPTree(lambda node: self.store.contains(self.keys.for_node(node)))

    def lookup(self, key: CacheKey, lazy: bool = False) -> ChunkKV | None:
        return self.store.get(key)

    def precompute_chunk(self, chunk_seg: Segment, prefix: Segment, tenant: str,
                         lead: tuple[int, ...] = ()) -> tuple[ChunkKV, int]:
        raise AssertionError("planning with misses computed in place must not compute")

    def entry(self, token_ids: tuple[int, ...], tenant: str = "") -> ChunkKV:
        n = len(token_ids)
        return ChunkKV(torch.zeros(2, n, 1, 4), torch.zeros(2, n, 1, 4), torch.tensor(token_ids), None, tenant)


@pytest.fixture
def state(tiny_llama_dir) -> MemoryState:
    return MemoryState(PromptBuilder.load(tiny_llama_dir))


def _plan(state: MemoryState, policy: str = "cacheblend", tenant: str = ""):
    prompt = ChunkedPrompt(chunks=CHUNKS, question="Which river reaches the Atlantic?")
    return Planner(state).plan(prompt, parse_policy(policy), tenant, use_prefix_tree=True, dedup=True)


def test_all_miss_plans_every_chunk_in_place_and_writes_nothing(state):
    planned = _plan(state)
    kinds = [s.kind for s in state.builder.build(ChunkedPrompt(chunks=CHUNKS, question="q")).segments]
    assert [(s.kind, s.mode) for s in planned.plan.spans] == [(kind, "fresh") for kind in kinds]
    assert kinds.count("chunk") == 3 and kinds[0] == "prefix" and kinds[-1] == "question"
    assert (planned.hits, planned.misses) == (0, 3)
    assert [index for index, _, _ in planned.in_place] == [i for i, kind in enumerate(kinds) if kind == "chunk"]
    assert state.store.stats().ram_entries == 0 and state.cptree.nodes() == 0 and state.cptree.roots() == 0


def test_held_kv_is_fused_and_the_stored_prefix_is_exact(state):
    assembled = state.builder.build(ChunkedPrompt(chunks=CHUNKS, question="q"))
    chunks = [i for i, s in enumerate(assembled.segments) if s.kind == "chunk"]
    prefix, b = assembled.segments[0], assembled.segments[chunks[1]]
    state.store.put(state.keys.for_tokens(prefix.token_ids, "", "exact"), state.entry(prefix.token_ids))
    state.store.put(state.keys.for_tokens(b.token_ids, "", IN_CONTEXT), state.entry(b.token_ids))
    planned = _plan(state)
    expected = ["exact"] + ["fuse" if i == chunks[1] else "fresh" for i in range(1, len(assembled.segments))]
    assert [s.mode for s in planned.plan.spans] == expected
    assert (planned.hits, planned.misses) == (1, 2)
    # another tenant sees none of it
    other = _plan(state, tenant="t2")
    assert [s.mode for s in other.plan.spans] == ["fresh"] * len(assembled.segments)


def test_full_policy_plans_without_reading_the_store(state):
    assembled = state.builder.build(ChunkedPrompt(chunks=CHUNKS, question="q"))
    b = assembled.segments[2]
    state.store.put(state.keys.for_tokens(b.token_ids, "", IN_CONTEXT), state.entry(b.token_ids))
    planned = _plan(state, "full")
    assert all(s.mode == "fresh" for s in planned.plan.spans) and planned.in_place == []


def test_token_digests_name_stored_kv_as_they_always_did():
    """A store written before stays readable: a token sequence's digest is blake2b-128 of its ids
    as int64 in machine order, whatever container the ids come in, however often it is asked."""
    import hashlib

    from engine_sidecar.request.fingerprint import token_ids_digest

    ids = [1, 255, 256, 49151, 2**31 - 1, 0]
    expected = hashlib.blake2b(torch.tensor(ids, dtype=torch.int64).numpy().tobytes(), digest_size=16).hexdigest()
    assert token_ids_digest(ids) == token_ids_digest(tuple(ids)) == token_ids_digest(ids) == expected
    assert token_ids_digest(ids[:-1]) != expected and token_ids_digest([]) != expected
