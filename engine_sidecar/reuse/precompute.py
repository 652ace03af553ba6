"""Chunk KV computed outside any request: alone (`warm`, `precompute=inline` misses on the
request's path, `precompute=background` misses on a worker thread after the request), or after
its nearest passages (`warm --neighbours`)."""

from __future__ import annotations

import logging
import queue
import threading

import torch

from engine_sidecar.execution.fused_prefill import PrefillResult, fused_prefill
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import ReusePolicy
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.request.fingerprint import token_ids_digest
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.request.prompt import Passage, Segment
from engine_sidecar.reuse.commit import ReuseWriter
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.entry import IN_CONTEXT, LEAD_META, ChunkKV

log = logging.getLogger("ragcache.precompute")


class Precomputer:
    def __init__(self, runner: ModelRunner, store: ChunkStore, keys: KeyFactory, writer: ReuseWriter,
                 lock: threading.RLock):
        self.runner, self.store, self.keys, self.writer = runner, store, keys, writer
        self._lock = lock  # the engine's: a warm-up runs between scheduler steps
        self._background: queue.Queue[tuple[Segment, Segment, str] | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    def compute_chunk_kv(self, chunk_seg: Segment, prefix: Segment, tenant: str,
                         lead: tuple[int, ...] = ()) -> ChunkKV:
        return self.precompute_chunk(chunk_seg, prefix, tenant, lead)[0]

    def precompute_chunk(self, chunk_seg: Segment, prefix: Segment, tenant: str,
                         lead: tuple[int, ...] = ()) -> tuple[ChunkKV, int]:
        """A chunk's KV computed alone (after the prefix under the after-prefix convention), and
        the token-layers that cost. `lead`: the passage's first word, computed before its core so
        the core's first tokens see it, as they do in a prompt; recorded in the entry's meta
        (`lead`), since after-prefix KV is exact only behind the same tokens."""
        spans = [self._prefix_span(prefix, tenant)] if self.keys.convention == "after-prefix" else []
        if lead:
            spans.append(PlanSpan("separator", spans[-1].end if spans else 0, lead, "fresh"))
        start = spans[-1].end if spans else 0
        spans.append(PlanSpan("chunk", start, chunk_seg.token_ids, "fresh", chunk_id=chunk_seg.chunk_id))
        result = self._compute(spans, tenant)
        end = start + len(chunk_seg.token_ids)
        entry = ChunkKV(result.kv.keys_pre[:, start:end].clone(), result.kv.values[:, start:end].clone(),
                        torch.tensor(chunk_seg.token_ids, dtype=torch.long), chunk_seg.chunk_id, tenant,
                        {LEAD_META: token_ids_digest(lead)})
        return entry, result.token_layers_computed

    def _prefix_span(self, prefix: Segment, tenant: str) -> PlanSpan:
        """The template prefix as a plan's first span: its exact entry where one is stored, else
        computed (and then stored by `_compute`)."""
        cached = self.store.get(self.keys.for_tokens(prefix.token_ids, tenant, "exact"))
        return PlanSpan("prefix", 0, prefix.token_ids, "exact" if cached else "fresh", cached)

    def _compute(self, spans: list[PlanSpan], tenant: str) -> PrefillResult:
        """The spans prefilled with nothing recomputed; a template prefix computed here is stored
        so the next chunk and request start from it."""
        result = fused_prefill(self.runner, FusionPlan(spans, "precompute"), ReusePolicy(), need_logits=False)
        if spans[0].kind == "prefix" and spans[0].cached is None:
            self.writer.store_span(result.kv, spans[0], tenant, "exact")
        return result

    def warm_segment(self, seg: Segment, prefix: Segment, tenant: str, lead: tuple[int, ...] = ()) -> int:
        """The chunk computed alone (after `lead`) and stored; the tokens that prefilled (0: it
        was cached)."""
        key = self.keys.for_tokens(seg.token_ids, tenant, self.keys.chunk_context(prefix))
        with self._lock:
            if self.store.contains(key):
                return 0
            entry, token_layers = self.precompute_chunk(seg, prefix, tenant, lead)
            self.store.put(key, entry)
        return token_layers // self.runner.num_layers

    def warm_after_neighbours(self, passage: Passage, prefix: Segment, neighbours: list[Segment],
                              tenant: str) -> int:
        """The passage's core computed after the template prefix, `neighbours` (whole passages)
        and its own first word, kept as its in-context entry (the KV fusion prefers): what a
        request retrieving it with them would compute. Returns the tokens that prefilled, the
        neighbours' included (0: it was cached)."""
        seg = passage.core
        key = self.keys.for_tokens(seg.token_ids, tenant, IN_CONTEXT)
        with self._lock:
            if self.store.contains(key):
                return 0
            spans = [self._prefix_span(prefix, tenant)]
            for other in [*neighbours, passage.head, seg]:
                spans.append(PlanSpan(other.kind, spans[-1].end, other.token_ids, "fresh", chunk_id=other.chunk_id))
            result = self._compute(spans, tenant)
            # no "chain": the passages before it are not the request's, so it is never reused exactly
            meta = {"context": IN_CONTEXT, "start": str(spans[-1].start), "warmed": "neighbours",
                    "after_chunks": ",".join(n.chunk_id or "" for n in neighbours)}
            self.writer.store_span(result.kv, spans[-1], tenant, IN_CONTEXT, meta)
        return result.token_layers_computed // self.runner.num_layers

    def _background_loop(self) -> None:
        while True:
            item = self._background.get()
            try:
                if item is None:
                    return
                seg, prefix, tenant = item
                self.warm_segment(seg, prefix, tenant, seg.lead)
            except Exception:  # a failed warm only means a later miss
                log.exception("background precompute failed")
            finally:
                self._background.task_done()

    def enqueue_background(self, seg: Segment, prefix: Segment, tenant: str) -> None:
        # the segment itself, not its chunk's text: in the verbatim layout a chunk's tokens
        # come from the whole prompt's tokenization
        if self._worker is None:
            self._worker = threading.Thread(target=self._background_loop, name="ragcache-precompute", daemon=True)
            self._worker.start()
        self._background.put((seg, prefix, tenant))

    def wait_background(self) -> None:
        """Block until background precompute work queued so far is stored."""
        self._background.join()

    def close(self) -> None:
        if self._worker is not None:
            self._background.put(None)
            self._worker.join(timeout=30)
            self._worker = None
