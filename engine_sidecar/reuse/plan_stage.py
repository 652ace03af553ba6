"""One request's planning as the engine runs it: the planner asked with disk-tier reads left lazy
when prefetch can stream them, a history that no longer fits dropped, and `:auto` policies given
their ratio from the costs measured so far."""

from __future__ import annotations

from engine_sidecar.engine_config import EngineConfig
from engine_sidecar.execution.cachecraft import VariantIndex
from engine_sidecar.execution.costs import CostMeter
from engine_sidecar.execution.fused_temperature import is_tempered
from engine_sidecar.execution.policies import Policy
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.request.prompt import PromptBuilder, Segment
from engine_sidecar.request.reorder import ChunkAccessTable
from engine_sidecar.reuse.commit import ReuseWriter
from engine_sidecar.reuse.conversation import ConversationStore
from engine_sidecar.reuse.cptree import CPTree
from engine_sidecar.reuse.planner import PlannedRequest, Planner
from engine_sidecar.reuse.precompute import Precomputer
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.entry import CacheKey, ChunkKV
from ragcache_integrations.types import ChunkedPrompt


class PlanStage:
    """The owner of planning's reads: it holds the caches and indexes a plan is made from and
    hands itself to the Planner as its PlanningState, so planning never sees the Engine."""

    def __init__(self, builder: PromptBuilder, keys: KeyFactory, store: ChunkStore, cptree: CPTree,
                 variants: VariantIndex, conversations: ConversationStore, access_table: ChunkAccessTable,
                 writer: ReuseWriter, precomputer: Precomputer, costs: CostMeter, config: EngineConfig):
        self.builder, self.keys, self.store, self.cptree, self.variants = builder, keys, store, cptree, variants
        self.conversations, self.access_table, self.config = conversations, access_table, config
        self.writer, self.precomputer, self.costs = writer, precomputer, costs
        self.lazy_reads = False  # set only while this stage is planning
        self.planner = Planner(self)

    def lookup(self, key: CacheKey) -> ChunkKV | None:
        """A store read during planning: disk-tier entries stay on disk for layer-wise prefetch
        when this request allows it."""
        return self.store.get(key, lazy=self.lazy_reads)

    def precompute_chunk(self, chunk_seg: Segment, prefix: Segment, tenant: str,
                         lead: tuple[int, ...] = ()) -> tuple[ChunkKV, int]:
        return self.precomputer.precompute_chunk(chunk_seg, prefix, tenant, lead)

    def plan(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, lazy: bool = True) -> PlannedRequest:
        disk_hits, redis_hits = self.store.hits_disk, self.store.hits_redis
        if policy.records_variants:
            self.writer.load_variants()
        # policies that read every cached layer before layer 0 (CacheTune's scores) load eagerly
        self.lazy_reads = lazy and self.config.store.prefetch and not policy.needs_cached_kv
        try:
            planned = self.planner.plan(prompt, policy, tenant, self.config.reuse.prefix_tree,
                                        self.config.conversations.dedup)
        finally:
            self.lazy_reads = False
        fused = [span for span in planned.plan.spans if span.mode == "fuse"]
        tempered = sum(is_tempered(span.cached, policy) for span in fused)
        if tempered:
            planned.plan.notes.append(f"attention temperature {policy.temperature:g} on the fused chunks' KV" + (
                "" if tempered == len(fused) else f" ({tempered} of {len(fused)}; the calibrated T is left off "
                                                  "KV warmed after neighbours)"))
        if policy.auto:
            # r0 for the slowest tier this request's cached KV came from (costs.py)
            tier = ("redis" if self.store.hits_redis > redis_hits else
                    "disk" if self.store.hits_disk > disk_hits else "ram")
            policy.ratio = self.costs.ratio(tier)
            compute = f"{self.costs.compute * 1e3:.3f} ms" if self.costs.compute is not None else "not measured yet"
            load = f"{self.costs.load[tier] * 1e6:.2f} us" if tier in self.costs.load else "not measured yet"
            planned.plan.notes.append(f"auto ratio {policy.ratio:.3f} for the {tier} tier "
                                      f"(per token: compute {compute}, load {load})")
        return planned

    def plan_to_fit(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, max_tokens: int,
                    max_context: int) -> PlannedRequest:
        """The plan, after dropping the conversation whole when its history no longer leaves
        room for `max_tokens` in the context window (the turn then starts over)."""
        planned = self.plan(prompt, policy, tenant)
        if planned.plan.num_tokens + max_tokens > max_context and planned.conversation:
            self.conversations.drop(tenant, prompt.conversation_id or "")
            planned = self.plan(prompt, policy, tenant)
            planned.plan.notes.append("conversation evicted: history over the context window")
        return planned
