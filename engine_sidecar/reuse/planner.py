"""Planner: chunk-structured prompt -> FusionPlan.

Order of decisions (each step only sees what the previous left):
  conversation history (exact) and dedup of chunks it already holds
  -> template prefix (exact when cached)
  -> longest CP-Tree path over the leading chunks (exact, no rotation, no recompute)
  -> promotion: chunks right after the path that reached the threshold are computed with full
     attention and become tree nodes
  -> the remaining chunks through the fusion policy (rotated cached KV + selective recompute)
  -> the question (fresh).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from engine_sidecar.engine_config import EngineConfig
from engine_sidecar.execution.cachecraft import (
    AttentionRecorder,
    RecordedChunk,
    VariantIndex,
    tokens_to_recompute,
)
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import CacheUse, Policy, VariantChoice
from engine_sidecar.request.fingerprint import token_ids_digest
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.request.prompt import AssembledPrompt, PromptBuilder, Segment, segment_digest
from engine_sidecar.request.reorder import ChunkAccessTable, access_key
from engine_sidecar.reuse.conversation import Conversation, ConversationStore
from engine_sidecar.reuse.cptree import CPNode, CPTree, chain_digest
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.entry import IN_CONTEXT, LEAD_META, CacheKey, ChunkKV
from ragcache_integrations.types import ChunkedPrompt


class PlanningState(Protocol):
    """What planning reads: the caches, the indexes and the settings (ReuseCache, which owns them).
    Planning still inserts CP-Tree nodes, rewards Cache-Craft variants and (with inline
    precompute) stores chunk KV; everything a prefill computes is stored by the engine after it
    succeeds."""

    builder: PromptBuilder
    keys: KeyFactory
    config: EngineConfig
    store: ChunkStore
    cptree: CPTree
    variants: VariantIndex
    conversations: ConversationStore
    access_table: ChunkAccessTable

    def lookup(self, key: CacheKey, lazy: bool = False) -> ChunkKV | None: ...

    def precompute_chunk(self, chunk_seg: Segment, prefix: Segment, tenant: str,
                         lead: tuple[int, ...] = ()) -> tuple[ChunkKV, int]: ...


# key context of chunk KV computed inside a request (a miss computed in place), any position


@dataclass
class PlannedRequest:
    plan: FusionPlan
    hits: int = 0
    misses: int = 0
    background: list[tuple[Segment, Segment]] = field(default_factory=list)  # (chunk, prefix)
    new_nodes: list[tuple[int, CPNode]] = field(default_factory=list)  # (span index, proposed node) to store
    conversation: Conversation | None = None
    dropped_chunk_ids: list[str] = field(default_factory=list)
    chunk_ids: list[str] = field(default_factory=list)
    chunk_digests: list[str] = field(default_factory=list)  # token digests of this turn's chunks
    craft: list[RecordedChunk] = field(default_factory=list)  # Cache-Craft chunks to record as variants
    # misses computed in place: (span index, key, chain digest of the exact KV before it or None),
    # stored from the KV buffer after a successful prefill
    in_place: list[tuple[int, CacheKey, str | None]] = field(default_factory=list)
    # the policy the prefill selects with: the request's, with an `:auto` ratio resolved
    policy: Policy | None = None
    # what it was planned from (ReuseCache.plan sets them): a file found damaged mid-read is
    # planned again from them with whole-file reads
    prompt: ChunkedPrompt | None = None
    tenant: str = ""
    precompute_token_layers: int = 0  # work done before the prefill (inline precompute of misses)
    precompute_s: float = 0.0

    def observer(self) -> AttentionRecorder | None:
        return AttentionRecorder(self.craft) if self.craft else None


def _behind_prefix_as_computed(out: PlannedRequest, prefix: Segment, entry: ChunkKV) -> bool:
    """Whether after-prefix KV sits where it was computed: right behind the template prefix and
    the tokens it was computed after (the passage's first word), no chunk between."""
    spans = out.plan.spans
    if not spans or spans[0].kind != "prefix" or spans[0].token_ids != prefix.token_ids:
        return False
    if any(s.kind != "separator" for s in spans[1:]):
        return False
    between = [t for s in spans[1:] for t in s.token_ids]
    return entry.meta.get(LEAD_META, token_ids_digest(())) == token_ids_digest(between)


def edge_digests(segments: list[Segment]) -> list[str]:
    """CP-Tree edge names, one per chunk: the chunk together with the text between it and the
    previous chunk (verbatim layout), so the same chunks with other text between them are
    another path. The two are digested apart: separator [a] + chunk [b] must not name chunk
    [a, b]."""
    digests: list[str] = []
    between: list[int] = []
    for seg in segments:
        if seg.kind == "chunk":
            digests.append(chain_digest(token_ids_digest(between), segment_digest(seg)) if between
                           else segment_digest(seg))
            between = []
        else:
            between.extend(seg.token_ids)
    return digests


@dataclass(frozen=True)
class _ChunkRequest:
    """What every chunk of one request is planned against."""

    prefix: Segment
    use: CacheUse  # how the request's policy treats cached KV
    tenant: str
    chunk_segs: list[Segment]
    digests: list[str]  # token digest of each chunk


@dataclass
class _TreeWalk:
    """Where the walk over a request's chunks stands on the CP-Tree: the matched path, the node a
    promoted chunk hangs under, and whether all KV so far is exact and on the tree (only then may
    the next chunk become a node)."""

    root: str | None
    edges: list[str]  # edge digest of each chunk
    path: list[CPNode]
    parent: CPNode | None
    extending: bool


class Planner:
    def __init__(self, state: PlanningState, lazy_reads: bool = False):
        """`lazy_reads`: disk-tier entries found while planning stay on disk for the prefill's
        layer-wise prefetch."""
        self.state, self.lazy_reads = state, lazy_reads

    def root_digest(self, prefix: Segment, tenant: str) -> str:
        return chain_digest(tenant, token_ids_digest(prefix.token_ids))

    def node_key(self, node: CPNode) -> CacheKey:
        return self.state.keys.for_node(node)

    def plan(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, use_prefix_tree: bool,
             dedup: bool) -> PlannedRequest:
        state = self.state
        if prompt.messages is not None:
            return self._plan_verbatim(prompt, policy, tenant, use_prefix_tree)
        use = policy.cache_use()
        conv = None
        if prompt.conversation_id:
            conv = state.conversations.get(tenant, prompt.conversation_id)
            if conv is not None and conv.system != prompt.system:
                state.conversations.drop(tenant, prompt.conversation_id)
                conv = None
        if conv is not None:
            known = conv.chunk_digests if dedup else set()
            assembled = state.builder.build_followup(prompt, known)
            out = PlannedRequest(FusionPlan([], policy.name), conversation=conv)
            out.dropped_chunk_ids = [s.chunk_id or "" for s in state.builder.build(prompt).segments
                                     if s.kind == "chunk" and segment_digest(s) in known]
            history = PlanSpan("history", 0, tuple(conv.history.token_ids.tolist()),
                               "exact" if use.lookup else "fresh",
                               conv.history if use.lookup else None)
            out.plan.spans.append(history)
            out.plan.notes.append(f"conversation turn {conv.turns + 1}: {history.end} history tokens reused")
            prefix = state.builder.prefix_segment(prompt.system)
            self._chunks_and_question(out, assembled.segments, history.end, prefix, policy, tenant, prompt,
                                      tree_root=None)
            return out
        return self._from_prefix(state.builder.build(prompt), policy, tenant, prompt, use_prefix_tree)

    def _from_prefix(self, assembled: AssembledPrompt, policy: Policy, tenant: str, prompt: ChunkedPrompt,
                     use_prefix_tree: bool) -> PlannedRequest:
        """No kept history: template prefix (exact when stored), then chunks and question."""
        state = self.state
        out = PlannedRequest(FusionPlan([], policy.name))
        prefix = assembled.segments[0]
        span = PlanSpan("prefix", 0, prefix.token_ids, "fresh")
        use = policy.cache_use()
        if use.lookup and prefix.token_ids:
            span.cached = state.lookup(state.keys.for_tokens(prefix.token_ids, tenant, "exact"), self.lazy_reads)
            span.mode = "exact" if span.cached is not None else "fresh"
        out.plan.spans.append(span)
        root = self.root_digest(prefix, tenant) if (use_prefix_tree and use.lookup) else None
        self._chunks_and_question(out, assembled.segments[1:], span.end, prefix, policy, tenant, prompt, root,
                                  chain_root=self.root_digest(prefix, tenant))
        return out

    def _plan_verbatim(self, prompt: ChunkedPrompt, policy: Policy, tenant: str,
                       use_prefix_tree: bool) -> PlannedRequest:
        """Verbatim layout. A conversation's next turn re-sends the whole chat, so its KV is
        reused exactly for the longest common token prefix with the kept history (the earlier
        turns, as far as the template re-renders them identically); the rest is planned as usual."""
        state = self.state
        assembled = state.builder.build(prompt)
        conv = state.conversations.get(tenant, prompt.conversation_id) if prompt.conversation_id else None
        tokens = assembled.token_ids
        if conv is not None and policy.cache_use().lookup:
            history = conv.history.token_ids.tolist()
            limit = min(len(history), len(tokens) - 1)  # the last prompt token is computed: logits
            same = 0
            while same < limit and history[same] == tokens[same]:
                same += 1
            prefix_ids = assembled.segments[0].token_ids
            # the history wins unless it covers less than a template prefix the store holds exactly
            if same > len(prefix_ids) or (same > 0 and not state.store.contains(
                    state.keys.for_tokens(prefix_ids, tenant, "exact"))):
                out = PlannedRequest(FusionPlan([], policy.name), conversation=conv)
                kept = ChunkKV(conv.history.keys[:, :same], conv.history.values[:, :same],
                               conv.history.token_ids[:same], None, tenant)
                out.plan.spans.append(PlanSpan("history", 0, tuple(tokens[:same]), "exact", kept))
                out.plan.notes.append(f"conversation turn {conv.turns + 1}: {same} history tokens reused")
                rest, start = [], 0
                for seg in assembled.segments:
                    end = start + len(seg.token_ids)
                    if end > same:  # a part the history covers only in part is computed fresh
                        rest.append(seg if start >= same else Segment("separator", seg.token_ids[same - start:]))
                    start = end
                self._chunks_and_question(out, rest, same, assembled.segments[0], policy, tenant, prompt, None)
                return out
        return self._from_prefix(assembled, policy, tenant, prompt, use_prefix_tree)

    def _chunks_and_question(self, out: PlannedRequest, segments: list[Segment], pos: int, prefix: Segment,
                             policy: Policy, tenant: str, prompt: ChunkedPrompt, tree_root: str | None,
                             chain_root: str | None = None) -> None:
        """The spans after the prefix or history, in order: each chunk as `_plan_chunk` decides,
        the text between chunks and the question fresh."""
        chunk_segs = [s for s in segments if s.kind == "chunk"]
        out.chunk_ids = [s.chunk_id or "" for s in chunk_segs]
        digests = [segment_digest(s) for s in chunk_segs]
        out.chunk_digests = digests
        request = _ChunkRequest(prefix, policy.cache_use(), tenant, chunk_segs, digests)
        walk = self._tree_walk(segments, tree_root, tenant)
        chunk_index = 0
        # digest of every token before `pos` while all of their KV is exact (reused at the
        # positions it was computed at, or computed here in full); None after a fused span
        chain = chain_root
        for seg in segments:
            span = PlanSpan(seg.kind, pos, seg.token_ids, "fresh", chunk_id=seg.chunk_id)
            chain_before = chain
            if chain is not None:
                chain = chain_digest(chain, token_ids_digest(seg.token_ids))
            if seg.kind == "chunk":
                self._plan_chunk(out, span, seg, chunk_index, chain_before, walk, request)
                chunk_index += 1
            if span.mode == "fuse":
                chain = None
            out.plan.spans.append(span)
            pos = span.end

    def _tree_walk(self, segments: list[Segment], tree_root: str | None, tenant: str) -> _TreeWalk:
        """The longest CP-Tree path over the leading chunks, where the walk starts from."""
        edges = edge_digests(segments)
        path = self.state.cptree.match(tree_root, edges, tenant) if tree_root is not None else []
        # parent None: the root, created when a node is committed
        return _TreeWalk(tree_root, edges, path, parent=path[-1] if path else None,
                         extending=tree_root is not None)

    def _plan_chunk(self, out: PlannedRequest, span: PlanSpan, seg: Segment, i: int, chain_before: str | None,
                    walk: _TreeWalk, request: _ChunkRequest) -> None:
        """Chunk `i`'s span, first that applies: exact KV from the tree path, exact KV computed in
        place after the same exact KV, a promotion to a tree node, else what the policy does with
        a chunk (Cache-Craft variant, fusion, or a miss)."""
        if self._exact_on_path(out, span, i, walk):
            return
        use, tenant = request.use, request.tenant
        # one read of the chunk's in-context entry serves the exact check and fusion below
        peeked = self._in_place_entry(seg, tenant, use)
        if chain_before is not None and peeked is not None and peeked.meta.get("chain") == chain_before:
            span.cached, span.mode = peeked, "exact"
            out.hits += 1
            # (the tree cannot grow past a chunk it does not hold: later chunks fuse or miss)
            walk.extending = False
            return
        if self._promote(out, span, seg, i, chain_before, walk, request):
            return
        walk.extending = False
        if use.variants is not None:
            self._craft(out, span, request.digests[i], tuple(request.digests[:i]), tenant, use.variants)
        elif use.lookup and use.fuses:
            self._fuse_or_miss(out, span, seg, request.prefix, tenant, chain_before, peeked)
        else:
            out.misses += int(use.lookup)

    def _exact_on_path(self, out: PlannedRequest, span: PlanSpan, i: int, walk: _TreeWalk) -> bool:
        """Whether chunk `i` is on the matched tree path with its node's KV still stored."""
        if i >= len(walk.path):
            return False
        span.cached = self.state.lookup(self.node_key(walk.path[i]), self.lazy_reads)
        if span.cached is None:
            walk.extending = False  # evicted between match and lookup: fall back below
            return False
        span.mode = "exact"
        out.hits += 1
        return True

    def _promote(self, out: PlannedRequest, span: PlanSpan, seg: Segment, i: int, chain_before: str | None,
                 walk: _TreeWalk, request: _ChunkRequest) -> bool:
        """Whether chunk `i` is computed with full attention right after exact KV and proposed as a
        tree node."""
        state = self.state
        use, tenant = request.use, request.tenant
        # A chunk computed with full attention anyway (exact-reuse policies, or a fusion
        # miss) becomes a node for free; a chunk fusion could reuse costs a full compute
        # of the chunk instead, so it waits for a higher access count.
        fusable = use.fuses and (use.variants is not None or self._fusable(seg, request.prefix, tenant))
        reuse = state.config.reuse
        threshold = reuse.fusion_promote_threshold if fusable else reuse.promote_threshold
        if not (walk.extending and walk.root is not None and threshold is not None
                and self._promotable(request.chunk_segs[: i + 1], threshold, tenant)):
            return False
        # computed with full attention after exact KV: exact, so it becomes a node
        # (proposed here, inserted by the engine after the prefill stored its KV)
        node = state.cptree.propose(walk.parent, walk.root, walk.edges[i], seg.chunk_id, tenant)
        out.new_nodes.append((len(out.plan.spans), node))
        if use.fuses and not fusable and use.variants is None:
            # the same KV serves fusion when the chunk comes back elsewhere
            out.in_place.append((len(out.plan.spans), state.keys.for_tokens(seg.token_ids, tenant, IN_CONTEXT),
                                 chain_before))
        walk.parent = node
        out.misses += 1
        if fusable:
            walk.extending = False  # fusion policies extend the path by one reusable chunk per request
        return True

    def _in_place_entry(self, seg: Segment, tenant: str, use: CacheUse) -> ChunkKV | None:
        """The chunk's KV computed in place by an earlier request (fusion policies only)."""
        if not (use.lookup and use.fuses) or use.variants is not None:
            return None
        return self.state.lookup(self.state.keys.for_tokens(seg.token_ids, tenant, IN_CONTEXT), self.lazy_reads)

    def _fusable(self, seg: Segment, prefix: Segment, tenant: str) -> bool:
        """Whether fusion has stored KV for this chunk (any context)."""
        store, state = self.state.store, self.state
        return (store.contains(state.keys.for_tokens(seg.token_ids, tenant, IN_CONTEXT))
                or store.contains(state.keys.for_tokens(seg.token_ids, tenant, state.keys.chunk_context(prefix))))

    def _promotable(self, segs: list[Segment], threshold: int, tenant: str) -> bool:
        counts = [self.state.access_table.count(access_key(tenant, s.chunk_id or "")) for s in segs]
        return self.state.cptree.should_promote(counts, threshold)

    def _craft(self, out: PlannedRequest, span: PlanSpan, digest: str, prior: tuple[str, ...], tenant: str,
               choose: VariantChoice) -> None:
        """Cache-Craft: reuse the chunk's lowest-CFO variant, or compute the chunk in this
        request's context and record it as a new variant."""
        state = self.state
        while (choice := state.variants.choose(tenant, digest, prior, choose.alpha)) is not None:
            if choice.cfo >= choose.fresh_above:
                out.plan.notes.append(f"cachecraft {span.chunk_id or digest[:8]}: best CFO {choice.cfo:.2f} "
                                      f">= {choose.fresh_above}: computed here, kept as a new variant")
                break
            cached = state.lookup(choice.variant.key, self.lazy_reads)
            if cached is not None:
                span.cached, span.mode = cached, "fuse"
                span.recompute = tokens_to_recompute(choice.variant.inter, choice.cfo)
                state.variants.reward(choice.variant, choice.cfo)
                out.hits += 1
                out.plan.notes.append(
                    f"cachecraft {span.chunk_id or digest[:8]}: CCI {choice.variant.cci:.2f}, beta {choice.beta:.2f}, "
                    f"gamma {choice.gamma:.2f}, CFO {choice.cfo:.2f} -> {len(span.recompute)}/{len(span)} tokens")
                return
            state.variants.discard(choice.variant)  # its KV left the store
        out.misses += 1
        prior_spans = [(s.start, s.end) for s in out.plan.spans if s.kind == "chunk"]
        out.craft.append(RecordedChunk(len(out.plan.spans), (span.start, span.end), prior_spans, prior, digest))

    def _fuse_or_miss(self, out: PlannedRequest, span: PlanSpan, seg: Segment, prefix: Segment,
                      tenant: str, chain_before: str | None, in_place: ChunkKV | None) -> None:
        """Fuse the chunk's stored KV (`in_place`: its in-context entry, already read), or plan
        the miss; `chain_before` names the exact KV before the chunk, recorded with a miss."""
        state = self.state
        key = state.keys.for_tokens(seg.token_ids, tenant, state.keys.chunk_context(prefix))
        in_place_key = state.keys.for_tokens(seg.token_ids, tenant, IN_CONTEXT)
        # KV computed in a request's context first: it saw a system prompt and neighbours, as the
        # chunk will now; a precomputed (warm / background / inline) entry otherwise
        span.cached = in_place
        from_precompute = span.cached is None
        if from_precompute:
            span.cached = state.lookup(key, self.lazy_reads)
        if span.cached is not None:
            out.hits += 1
        elif state.config.reuse.precompute == "in-place":
            out.misses += 1
            out.in_place.append((len(out.plan.spans), in_place_key, chain_before))
        elif state.config.reuse.precompute == "inline":
            started = time.perf_counter()
            span.cached, token_layers = state.precompute_chunk(seg, prefix, tenant, seg.lead)
            out.precompute_s += time.perf_counter() - started
            out.precompute_token_layers += token_layers
            state.store.put(key, span.cached)
            out.misses += 1
        else:
            out.misses += 1
            out.background.append((seg, prefix))
        if span.cached is not None:
            # After-prefix KV of the first chunk was computed at exactly these positions.
            exact = (from_precompute and state.config.reuse.convention == "after-prefix"
                     and out.conversation is None and _behind_prefix_as_computed(out, prefix, span.cached))
            span.mode = "exact" if exact else "fuse"
