"""After a successful prefill, the one writer of what it computed: the template prefix, CP-Tree
nodes, misses computed in place and Cache-Craft variants go into the store and the indexes here,
never during planning (a prefill that raises leaves them as they were)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_sidecar.execution.cachecraft import (
    VARIANT_META,
    Variant,
    VariantIndex,
    prefix_context,
    variant_from_meta,
    variant_to_meta,
)
from engine_sidecar.execution.fused_prefill import PrefillResult
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.request.fingerprint import token_ids_digest
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.reuse.cptree import CPTree
from engine_sidecar.reuse.planner import IN_CONTEXT, PlannedRequest
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.entry import LEAD_META, CacheKey, ChunkKV


class ReuseWriter:
    def __init__(self, store: ChunkStore, keys: KeyFactory, cptree: CPTree, variants: VariantIndex):
        self.store, self.keys, self.cptree, self.variants = store, keys, cptree, variants
        self.variants_loaded = False  # Cache-Craft's index is rebuilt from the disk tier once

    def store_span(self, kv: KVBuffer, span: PlanSpan, tenant: str, context: str,
                   meta: dict[str, str] | None = None, key: CacheKey | None = None) -> ChunkKV:
        key, entry = self._span_entry(kv, span, tenant, context, meta, key)
        self.store.put(key, entry)
        return entry

    def _span_entry(self, kv: KVBuffer, span: PlanSpan, tenant: str, context: str,
                    meta: dict[str, str] | None = None, key: CacheKey | None = None) -> tuple[CacheKey, ChunkKV]:
        entry = ChunkKV(kv.keys_pre[:, span.start : span.end].clone(), kv.values[:, span.start : span.end].clone(),
                        torch.tensor(span.token_ids, dtype=torch.long), span.chunk_id, tenant, dict(meta or {}))
        return key or self.keys.for_tokens(span.token_ids, tenant, context), entry

    def commit(self, planned: PlannedRequest, result: PrefillResult, tenant: str) -> None:
        """Keep what this request computed exactly: the template prefix, new CP-Tree nodes, misses
        computed in place, Cache-Craft variants, and under the after-prefix convention a first
        chunk computed fresh right after the prefix. Every entry's KV is checked finite in one
        host read for all of them, before any is stored (NonFiniteKVError: none is)."""
        plan = planned.plan
        if not plan.spans or plan.policy == "full":
            return
        writes = self._writes(planned, result.kv, tenant)
        self.store.check_finite([entry for _, entry, _ in writes])
        for key, entry, then in writes:
            self.store.put(key, entry, checked=True)
            if then is not None:
                then()

    def _first_chunk_after_prefix(self, plan: FusionPlan, kv: KVBuffer,
                                  tenant: str) -> list[tuple[CacheKey, ChunkKV, Callable[[], None] | None]]:
        """The first chunk computed fresh right behind a fresh template prefix (only its first
        word between) is what a precompute under the after-prefix convention stores."""
        lead: list[int] = []
        for span in plan.spans[1:]:
            if span.kind == "separator":
                lead.extend(span.token_ids)
                continue
            if span.kind != "chunk" or span.mode != "fresh":
                return []
            key, entry = self._span_entry(kv, span, tenant, self.keys.chunk_context(plan.spans[0]),
                                          {LEAD_META: token_ids_digest(lead)})
            return [(key, entry, None)]
        return []

    def _writes(self, planned: PlannedRequest, kv: KVBuffer,
                tenant: str) -> list[tuple[CacheKey, ChunkKV, Callable[[], None] | None]]:
        """What `commit` stores, in order, each with what follows its store (a CP-Tree node joins
        the tree only once its KV is stored; a variant joins the index the same way)."""
        plan = planned.plan
        writes: list[tuple[CacheKey, ChunkKV, Callable[[], None] | None]] = []
        first = plan.spans[0]
        if first.kind == "prefix" and first.mode == "fresh":
            writes.append((*self._span_entry(kv, first, tenant, "exact"), None))
            if self.keys.convention == "after-prefix":
                writes.extend(self._first_chunk_after_prefix(plan, kv, tenant))
        kept: dict[int, ChunkKV] = {}
        for index, proposed in planned.new_nodes:  # KV first: a node in the tree always has its KV
            key, kept[index] = self._span_entry(kv, plan.spans[index], tenant, "", key=self.keys.for_node(proposed))
            writes.append((key, kept[index], lambda proposed=proposed: self.cptree.commit(proposed)))
        for index, key, chain in planned.in_place:
            # a miss computed in this request: its pre-RoPE keys are position-free already; the
            # chunks it was computed after ride along for choosing among contexts later, and the
            # chain digest of the tokens before it when their KV was exact (a later request with
            # the same tokens before the chunk reuses it exactly, without recompute)
            span = plan.spans[index]
            before = [s.chunk_id or "" for s in plan.spans[:index] if s.kind == "chunk"]
            meta = {"context": IN_CONTEXT, "start": str(span.start), "after_chunks": ",".join(before)}
            if chain is not None:
                meta["chain"] = chain
            node = kept.get(index)
            if node is None:
                writes.append((*self._span_entry(kv, span, tenant, IN_CONTEXT, meta), None))
            else:  # the node's tensors under a second key
                writes.append((key, ChunkKV(node.keys, node.values, node.token_ids, span.chunk_id, tenant, meta), None))
        for rec in planned.craft:  # Cache-Craft: chunks computed in this request's context become variants
            span = plan.spans[rec.span_index]
            context = prefix_context(rec.prefix)
            variant = Variant(tenant, rec.chunk_digest, rec.prefix, rec.cci, rec.inter,
                              self.keys.for_tokens(span.token_ids, tenant, context))
            # the variant's metadata rides with its KV, so the index can be rebuilt after a restart
            writes.append((*self._span_entry(kv, span, tenant, context, {VARIANT_META: variant_to_meta(variant)}),
                           lambda variant=variant: self.add_variant(variant)))
        return writes

    def add_variant(self, variant: Variant) -> None:
        for evicted in self.variants.add(variant):
            if evicted.key != variant.key:
                self.store.remove(evicted.key)

    def load_variants(self) -> None:
        """Once per engine: rebuild Cache-Craft's variant index from the disk tier (variants of
        this model and tokenizer only: their keys must reproduce the file's digest)."""
        if self.variants_loaded:
            return
        self.variants_loaded = True
        if self.store.disk is None:
            return
        for digest in self.store.disk.digests():
            meta = self.store.disk.metadata(digest)
            if VARIANT_META not in meta:
                continue
            variant = variant_from_meta(meta[VARIANT_META], meta.get("tenant", ""),
                                        lambda chunk, tenant, context: self.keys.for_digest(chunk, tenant, context))
            if variant is not None and variant.key.digest == digest:
                self.add_variant(variant)
