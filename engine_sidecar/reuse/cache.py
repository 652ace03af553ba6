"""The reuse state one engine owns, and the two things a request asks of it: a plan for its prompt
from what is cached, and, after a prefill that succeeded, the commit of what it computed.

It holds the chunk store, the CP-Tree, Cache-Craft's variants, the kept conversations and the
Chunk-Access Table, the keys everything is filed under, the writer that stores a prefill's KV,
the precompute worker, and the per-token costs measured so far (compute, and each tier's load,
which the store reports after its reads). Nothing outside reads into it: the engine asks
`plan`, `commit`, `stats` and `clear`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine_sidecar.engine_config import EngineConfig
from engine_sidecar.errors import NON_FINITE_MESSAGE, NonFiniteLogitsError
from engine_sidecar.execution.cachecraft import VariantIndex
from engine_sidecar.execution.costs import CostMeter
from engine_sidecar.execution.fused_prefill import PrefillResult
from engine_sidecar.execution.fused_temperature import is_tempered
from engine_sidecar.execution.policies import Policy, RatioPolicy
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.request.prompt import PromptBuilder, Segment
from engine_sidecar.request.reorder import ChunkAccessTable
from engine_sidecar.reuse.commit import ReuseWriter
from engine_sidecar.reuse.conversation import Conversation, ConversationStore
from engine_sidecar.reuse.cptree import CPTree
from engine_sidecar.reuse.planner import PlannedRequest, Planner
from engine_sidecar.reuse.precompute import Precomputer
from engine_sidecar.store.chunk_store import ChunkStore, StoreStats
from engine_sidecar.store.entry import CacheKey, ChunkKV
from ragcache_integrations.types import ChunkedPrompt


@dataclass(frozen=True)
class ReuseStats:
    """What the cache holds, as plain counts."""

    store: StoreStats
    conversations: int  # kept conversations, all tenants
    cptree_nodes: int


class ReuseCache:
    def __init__(self, runner: ModelRunner, builder: PromptBuilder, store: ChunkStore, keys: KeyFactory,
                 config: EngineConfig, lock: threading.RLock):
        """`lock` is the engine's: background precompute takes it between scheduler steps."""
        self.builder, self.store, self.keys, self.config = builder, store, keys, config
        self.max_context = runner.config.max_position_embeddings
        reuse, talks = config.reuse, config.conversations
        self.access_table = ChunkAccessTable(reuse.ca_window)
        self.conversations = ConversationStore(talks.ttl_s, talks.max_tokens, talks.max_count, talks.ram_bytes)
        self.variants = VariantIndex(reuse.cachecraft_variants_per_chunk, reuse.cachecraft_max_chunks)
        self.cptree = CPTree(lambda node: store.contains(keys.for_node(node)), reuse.promote_threshold)
        self.costs = CostMeter()
        self.writer = ReuseWriter(store, keys, self.cptree, self.variants)
        self.precompute = Precomputer(runner, store, keys, self.writer, lock)

    # --- what planning reads (the Planner's PlanningState) -----------------------------------
    def lookup(self, key: CacheKey, lazy: bool = False) -> ChunkKV | None:
        """A store read during planning; with `lazy` a disk-tier entry stays on disk for the
        prefill's layer-wise prefetch."""
        return self.store.get(key, lazy=lazy)

    def precompute_chunk(self, chunk_seg: Segment, prefix: Segment, tenant: str,
                         lead: tuple[int, ...] = ()) -> tuple[ChunkKV, int]:
        return self.precompute.precompute_chunk(chunk_seg, prefix, tenant, lead)

    # --- a request's plan and commit ---------------------------------------------------------
    def plan(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, answer_tokens: int = 0,
             lazy: bool = True) -> PlannedRequest:
        """The prompt's FusionPlan from what is cached. Disk-tier reads stay lazy where prefetch
        can stream them (`lazy`, the setting, and a policy that does not read every cached layer
        first). A kept conversation whose history leaves no room for `answer_tokens` in the
        context window is dropped and the turn planned afresh. `:auto` policies get their ratio
        from the costs measured so far."""
        disk_hits, redis_hits = self.store.hits_disk, self.store.hits_redis
        use = policy.cache_use()
        if use.variants is not None:
            self.writer.load_variants()
        planner = Planner(self, lazy_reads=lazy and self.config.store.prefetch and not use.reads_all_layers_first)
        prefix_tree, dedup = self.config.reuse.prefix_tree, self.config.conversations.dedup
        planned = planner.plan(prompt, policy, tenant, prefix_tree, dedup)
        if planned.conversation and planned.plan.num_tokens + answer_tokens > self.max_context:
            self.conversations.drop(tenant, prompt.conversation_id or "")
            planned = planner.plan(prompt, policy, tenant, prefix_tree, dedup)
            planned.plan.notes.append("conversation evicted: history over the context window")
        self.observe_store_loads()
        self._note_temperature(planned, policy)
        planned.policy, planned.prompt, planned.tenant = policy, prompt, tenant
        if isinstance(policy, RatioPolicy) and policy.auto:
            # r0 for the slowest tier this request's cached KV came from (costs.py)
            tier = ("redis" if self.store.hits_redis > redis_hits else
                    "disk" if self.store.hits_disk > disk_hits else "ram")
            planned.policy = policy.at_ratio(self.costs.ratio(tier))
            planned.plan.notes.append(self._auto_note(planned.policy.ratio, tier))
        return planned

    def commit(self, planned: PlannedRequest, result: PrefillResult, tenant: str, check_logits: bool = True) -> None:
        """Keep what the prefill computed. NaN or infinity anywhere in the KV reaches the last
        token's logits (every query attends to every earlier key), so finite logits clear the
        whole prefill; a caller that already read that check (the first token's choice, in the
        same host sync) passes check_logits=False."""
        if check_logits and result.logits is not None and not bool(torch.isfinite(result.logits.max())):
            raise NonFiniteLogitsError(NON_FINITE_MESSAGE)
        self.writer.commit(planned, result, tenant)

    def keep_conversation(self, turn: Conversation) -> None:
        """Keep a finished turn's history for the conversation's next turn."""
        self.conversations.put(turn)

    def precompute_later(self, planned: PlannedRequest, tenant: str) -> None:
        """Queue the misses this request left for the background worker."""
        for chunk_seg, prefix in planned.background:
            self.precompute.enqueue_background(chunk_seg, prefix, tenant)

    def observe_store_loads(self) -> None:
        """Fold the store's reads since the last call into the per-token load costs."""
        for tier, seconds, tokens in self.store.drain_loads():
            self.costs.observe_load(tier, seconds, tokens)

    # --- housekeeping ------------------------------------------------------------------------
    def stats(self) -> ReuseStats:
        return ReuseStats(self.store.stats(), len(self.conversations), self.cptree.nodes())

    def clear(self, chunk_id: str | None = None, tenant: str | None = None) -> int:
        """Delete cached KV: everything, one chunk id's entries, or (with `tenant`) only that
        tenant's (all, or of one chunk id) with its conversations and variants. Returns how many
        store entries were removed."""
        if chunk_id is None:
            self.variants.clear(tenant)
            self.conversations.clear(tenant)
            if tenant is None:
                self.writer.variants_loaded = True  # the files are gone too
        return self.store.delete(chunk_id, tenant)

    def load_cost_ratio(self, tier: str) -> float | None:
        """Measured per-token cost of loading KV from `tier` over that of computing it; None until
        both have been seen."""
        self.observe_store_loads()
        load = self.costs.load.get(tier)
        if self.costs.compute is None or load is None or self.costs.compute <= 0:
            return None
        return load / self.costs.compute

    def close(self) -> None:
        """Stop the precompute worker, then finish the store's queued writes."""
        self.precompute.close()
        self.store.close()

    def _note_temperature(self, planned: PlannedRequest, policy: Policy) -> None:
        fused = [span for span in planned.plan.spans if span.mode == "fuse"]
        tempered = sum(is_tempered(span.cached, policy) for span in fused)
        if tempered:
            planned.plan.notes.append(f"attention temperature {policy.temperature:g} on the fused chunks' KV" + (
                "" if tempered == len(fused) else f" ({tempered} of {len(fused)}; the calibrated T is left off "
                                                  "KV warmed after neighbours)"))

    def _auto_note(self, ratio: float, tier: str) -> str:
        compute = f"{self.costs.compute * 1e3:.3f} ms" if self.costs.compute is not None else "not measured yet"
        load = f"{self.costs.load[tier] * 1e6:.2f} us" if tier in self.costs.load else "not measured yet"
        return f"auto ratio {ratio:.3f} for the {tier} tier (per token: compute {compute}, load {load})"
