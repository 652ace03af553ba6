"""The engine object: model runner + tokenizer + chunk store + planner + executor + decode.

It is the only stateful object in the sidecar; everything it hands between stages is plain data.
Generation requests become Sequences that the Scheduler serves in batches (one prefill or one
batched decode step at a time, under the engine's lock); warm-ups, clears and fidelity probes
take the same lock between steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from engine_sidecar.adaptive import CostMeter
from engine_sidecar.cachecraft import (
    VariantIndex,
)
from engine_sidecar.commit import ReuseWriter
from engine_sidecar.conversation import Conversation, ConversationStore
from engine_sidecar.cptree import CPTree
from engine_sidecar.engine_config import EngineConfig
from engine_sidecar.executor import KVBuffer, PrefillResult, decode_step, fused_prefill
from engine_sidecar.fingerprint import model_fingerprint, tokenizer_fingerprint
from engine_sidecar.keys import KeyFactory
from engine_sidecar.model.prepare import resolve_model_dir
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.paths import default_cache_dir
from engine_sidecar.plan import FusionPlan, PlanSpan
from engine_sidecar.planner import PlannedRequest, Planner
from engine_sidecar.policies import CacheCraftPolicy, Policy, parse_policy
from engine_sidecar.precompute import Precomputer
from engine_sidecar.prefill_stage import PrefillStage
from engine_sidecar.prompt import PromptBuilder, Segment
from engine_sidecar.reorder import ChunkAccessTable
from engine_sidecar.request_prep import RequestPreparer
from engine_sidecar.scheduler import Scheduler
from engine_sidecar.sequence import GenerationStream, Sequence
from engine_sidecar.stats import request_stats
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.entry import CacheKey, ChunkKV
from ragcache_integrations.types import (
    Chunk,
    ChunkedPrompt,
    GenerationResult,
    GenerationStats,
    SamplingParams,
)

log = logging.getLogger("ragcache.engine")
DEFAULT_SYSTEM = ChunkedPrompt.model_fields["system"].default


class Engine:
    def __init__(self, runner: ModelRunner, builder: PromptBuilder, store: ChunkStore, config: EngineConfig,
                 model_dir: Path):
        self.runner = runner
        self.builder = builder
        self.store = store
        self.config = config
        self.model_dir = model_dir
        self.model_fp = model_fingerprint(model_dir, runner.dtype)
        self.tokenizer_fp = tokenizer_fingerprint(model_dir, builder.chat_template)
        self.keys = KeyFactory(self.model_fp, self.tokenizer_fp, config.convention)
        self._lock = threading.RLock()
        self.eos_ids = self._eos_ids()
        self.access_table = ChunkAccessTable(config.ca_window)
        self.conversations = ConversationStore(config.conversation_ttl_s, config.conversation_max_tokens,
                                               config.conversation_max_count, config.conversation_ram_bytes)
        self.planner = Planner(self)
        self.variants = VariantIndex(config.cachecraft_variants_per_chunk, config.cachecraft_max_chunks)
        self.costs = CostMeter()
        self.prefill_stage = PrefillStage(runner, store, self.costs)
        self._lazy_reads = False
        store.on_disk_load = lambda seconds, tokens: self.costs.observe_load("disk", seconds, tokens)
        self.cptree = CPTree(lambda node: self.store.contains(self.keys.for_node(node)), config.promote_threshold)
        self.writer = ReuseWriter(store, self.keys, self.cptree, self.variants)
        self.precompute = Precomputer(runner, store, self.keys, self.writer, self._lock)
        self.prep = RequestPreparer(builder, self.access_table, store, self.keys, self.max_context)
        c = runner.config
        kv_row_bytes = 3 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=runner.dtype).element_size()
        self.scheduler = Scheduler(runner, self._lock, self._begin, self._complete, config.max_batch,
                                   max(1, config.batch_kv_bytes // kv_row_bytes))

    @classmethod
    def from_pretrained(cls, model: str | Path = "default", device: str = "auto", dtype: str = "auto",
                        **options) -> Engine:
        config = EngineConfig(model=str(model), device=device, dtype=dtype, **options)
        if config.threads:
            torch.set_num_threads(config.threads)
        model_dir = resolve_model_dir(config.model)
        runner = ModelRunner.load(model_dir, device=device, dtype=dtype)
        builder = PromptBuilder.load(model_dir)
        disk_dir = (config.cache_dir or default_cache_dir()) if config.disk else None
        store = ChunkStore(config.ram_cache_bytes, Path(disk_dir) if disk_dir else None, runner.device,
                           config.disk_cache_bytes)
        return cls(runner, builder, store, config, model_dir)

    # --- identity ----------------------------------------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids = set(self.runner.config.eos_token_ids)
        tok = self.builder.tokenizer
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tok.unk_token_id and name in tok.get_vocab():
                ids.add(tid)
        return ids

    @property
    def max_context(self) -> int:
        return self.runner.config.max_position_embeddings

    # --- precompute --------------------------------------------------------------------------
    def warm(self, chunks: list[Chunk | str], system: str | None = None, tenant: str = "") -> int:
        """Precompute and store KV for chunks not cached yet; returns how many were computed."""
        prefix = self.builder.prefix_segment(system if system is not None else DEFAULT_SYSTEM)
        computed = 0
        for i, raw in enumerate(chunks):
            chunk = Chunk(text=raw) if isinstance(raw, str) else raw
            seg = self.builder.chunk_segment(chunk)
            self.prep.check_chunk_fits(seg, i)
            computed += self.precompute.warm_segment(seg, prefix, tenant)
        return computed

    def compute_chunk_kv(self, chunk_seg: Segment, prefix: Segment, tenant: str) -> ChunkKV:
        return self.precompute.compute_chunk_kv(chunk_seg, prefix, tenant)

    def precompute_chunk(self, chunk_seg: Segment, prefix: Segment, tenant: str) -> tuple[ChunkKV, int]:
        return self.precompute.precompute_chunk(chunk_seg, prefix, tenant)

    def wait_background(self) -> None:
        """Block until background precompute work queued so far is stored."""
        self.precompute.wait_background()

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                 policy: str | Policy = "cacheblend", tenant: str = "", order: str = "preserve") -> GenerationResult:
        """Answer a chunk-structured prompt. `policy` picks the recompute strategy, `order`
        ('preserve', 'frequency' or 'hits-first') whether chunks are re-sorted by the CA-Table
        or with the chunks the cache holds first, `tenant` salts
        every cache key so tenants never share KV. With `prompt.conversation_id` the next turn
        continues from this one's KV."""
        stream = self.stream(prompt, sampling, policy, tenant, order)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
               policy: str | Policy = "cacheblend", tenant: str = "", order: str = "preserve") -> GenerationStream:
        prompt, sampling, pol = self.prep.prepare(prompt, sampling, policy, order, tenant)
        return GenerationStream(self._submit(prompt, sampling, pol, tenant))

    def prefill_logits(self, prompt: ChunkedPrompt | dict, policy: str | Policy = "cacheblend",
                       tenant: str = "", order: str = "preserve") -> tuple[torch.Tensor, GenerationStats]:
        """Next-token logits after the prompt, and the prefill's stats (for fidelity checks)."""
        logits, stats = self.teacher_forced_logits(prompt, [], policy, tenant, order)
        return logits[0], stats

    def teacher_forced_logits(self, prompt: ChunkedPrompt | dict, continuation: list[int],
                              policy: str | Policy = "cacheblend", tenant: str = "",
                              order: str = "preserve") -> tuple[torch.Tensor, GenerationStats]:
        """Logits [1 + len(continuation), vocab]: after the prompt, then after each token of
        `continuation` fed back in turn (teacher forcing). Along full prefill's own answer this
        compares a policy's next-token choices step by step, without free-running divergence."""
        prompt, _, pol = self.prep.prepare(prompt, None, policy, order, tenant)
        t0 = time.perf_counter()
        self.prep.validate(prompt, len(continuation) + 1)
        with self._lock:
            planned = self._plan(prompt, pol, tenant)
            capacity = planned.plan.num_tokens + len(continuation) + 1
            planned, result = self._prefill(planned, pol, prompt, tenant, capacity, {})
            self.writer.commit(planned, result, tenant)
            assert result.logits is not None
            rows = [result.logits]
            rows += [decode_step(self.runner, result.kv, token) for token in continuation]
        return torch.stack(rows), self._request_stats(planned, result, time.perf_counter() - t0, pol, {})

    def measure_full_prefill(self, prompt: ChunkedPrompt | dict) -> float:
        """Seconds an ordinary full prefill of this prompt takes now, without touching the cache,
        the CA-Table or conversations: the baseline a reuse figure is compared with."""
        prompt = prompt if isinstance(prompt, ChunkedPrompt) else ChunkedPrompt.model_validate(prompt)
        ids = tuple(self.builder.build(prompt).token_ids)
        with self._lock:
            start = time.perf_counter()
            fused_prefill(self.runner, FusionPlan([PlanSpan("question", 0, ids, "fresh")], "full"), parse_policy("full"))
            return time.perf_counter() - start

    def stream_chat(self, messages: list[dict[str, str]], sampling: SamplingParams | dict | None = None,
                    tenant: str = "") -> GenerationStream:
        """A plain chat completion (no chunks): the whole prompt is computed fresh."""
        sampling = sampling if isinstance(sampling, SamplingParams) else SamplingParams.model_validate(sampling or {})
        t0 = time.perf_counter()
        assembled = self.builder.build_chat(messages)
        self.prep.check_total(len(assembled), sampling.max_tokens)
        seg = assembled.segments[0]
        plan = FusionPlan([PlanSpan("question", 0, seg.token_ids, "fresh")], "full")
        seq = Sequence(sampling, parse_policy("full"), "", None, PlannedRequest(plan), len(assembled), t0)
        self.scheduler.submit(seq)
        return GenerationStream(seq.events())

    def _submit(self, prompt: ChunkedPrompt, sampling: SamplingParams, policy: Policy,
                tenant: str) -> Iterator[str | GenerationResult]:
        """Validate (a bad prompt raises here, before anything is queued), queue the sequence
        for the scheduler and hand on what it produces."""
        t0 = time.perf_counter()
        total = self.prep.validate(prompt, sampling.max_tokens)
        seq = Sequence(sampling, policy, tenant, prompt, None, total, t0, {"tokenize_s": time.perf_counter() - t0})
        self.scheduler.submit(seq)
        yield from seq.events()

    def _begin(self, seq: Sequence) -> bool:
        """Scheduler step (engine lock held): plan, prefill, keep what the prefill computed, sample
        the first token. True while the sequence wants more tokens."""
        started = time.perf_counter()
        seq.times["queue_s"] = started - seq.t0 - seq.times.get("tokenize_s", 0.0)
        planned = seq.planned
        if planned is None:
            assert seq.prompt is not None
            planned = self._plan(seq.prompt, seq.policy, seq.tenant)
            if planned.plan.num_tokens + seq.sampling.max_tokens > self.max_context and planned.conversation:
                # the history no longer fits: drop the conversation whole and start over
                self.conversations.drop(seq.tenant, seq.prompt.conversation_id or "")
                planned = self._plan(seq.prompt, seq.policy, seq.tenant)
                planned.plan.notes.append("conversation evicted: history over the context window")
            seq.times["plan_s"] = time.perf_counter() - started
        capacity = planned.plan.num_tokens + seq.sampling.max_tokens + 1
        planned, result = self._prefill(planned, seq.policy, seq.prompt, seq.tenant, capacity, seq.times)
        self.writer.commit(planned, result, seq.tenant)
        seq.planned = planned
        assert result.logits is not None
        stats = self._request_stats(planned, result, time.perf_counter() - seq.t0, seq.policy, seq.times)
        return seq.begin_decoding(result.logits, result.kv, stats, self.builder.decode, self.eos_ids)

    def _complete(self, seq: Sequence) -> None:
        """Scheduler step after a sequence's last token: keep its conversation and queue its
        background precompute, then post the result (a caller that acts on the result at once,
        with a next turn or `wait_background`, finds both done)."""
        assert seq.planned is not None and seq.kv is not None
        if seq.prompt is not None and seq.prompt.conversation_id:
            self._keep_conversation(seq.prompt, seq.planned, seq.kv, seq.generated, seq.tenant)
        for chunk_seg, prefix in seq.planned.background:
            self.precompute.enqueue_background(chunk_seg, prefix, seq.tenant)
        seq.finish()

    def _keep_conversation(self, prompt: ChunkedPrompt, planned: PlannedRequest, kv: KVBuffer,
                           generated: list[int], tenant: str) -> None:
        token_ids = planned.plan.token_ids + generated
        while kv.length < len(token_ids):  # the last sampled token was never fed back
            decode_step(self.runner, kv, token_ids[kv.length])
        n = len(token_ids)
        history = ChunkKV(kv.keys_pre[:, :n].clone(), kv.values[:, :n].clone(),
                          torch.tensor(token_ids, dtype=torch.long), None, tenant)
        previous = planned.conversation
        held = (previous.chunk_digests if previous else set()) | set(planned.chunk_digests)
        self.conversations.put(Conversation(tenant, prompt.conversation_id or "", prompt.system, history, held,
                                            turns=(previous.turns + 1) if previous else 1))

    def lookup(self, key: CacheKey) -> ChunkKV | None:
        """A store read during planning: disk-tier entries stay on disk for layer-wise prefetch
        when this request allows it."""
        return self.store.get(key, lazy=self._lazy_reads)

    def _plan(self, prompt: ChunkedPrompt, policy: Policy, tenant: str, lazy: bool = True) -> PlannedRequest:
        disk_hits = self.store.hits_disk
        if isinstance(policy, CacheCraftPolicy):
            self.writer.load_variants()
        # policies that read every cached layer before layer 0 (CacheTune's scores) load eagerly
        self._lazy_reads = lazy and self.config.prefetch and not policy.needs_cached_kv
        try:
            planned = self.planner.plan(prompt, policy, tenant, self.config.prefix_tree,
                                        self.config.conversation_dedup)
        finally:
            self._lazy_reads = False
        if policy.auto:
            # r0 for the slowest tier this request's cached KV came from (adaptive.py)
            tier = "disk" if self.store.hits_disk > disk_hits else "ram"
            policy.ratio = self.costs.ratio(tier)  # type: ignore[attr-defined]
            compute = f"{self.costs.compute * 1e3:.3f} ms" if self.costs.compute is not None else "not measured yet"
            load = f"{self.costs.load[tier] * 1e6:.2f} us" if tier in self.costs.load else "not measured yet"
            planned.plan.notes.append(f"auto ratio {policy.ratio:.3f} for the {tier} tier "  # type: ignore[attr-defined]
                                      f"(per token: compute {compute}, load {load})")
        return planned

    def _prefill(self, planned: PlannedRequest, policy: Policy, prompt: ChunkedPrompt | None, tenant: str,
                 capacity: int, times: dict[str, float]) -> tuple[PlannedRequest, PrefillResult]:
        replan = (lambda: self._plan(prompt, policy, tenant, lazy=False)) if prompt is not None else None
        return self.prefill_stage.run(planned, policy, capacity, times, replan)

    def _request_stats(self, planned: PlannedRequest, result: PrefillResult, ttft: float, policy: Policy,
                       times: dict[str, float]) -> GenerationStats:
        return request_stats(planned, result, ttft, policy, times, self.runner.num_layers, self.config.convention)

    # --- housekeeping ------------------------------------------------------------------------
    def clear_cache(self, chunk_id: str | None = None, tenant: str | None = None) -> int:
        """Delete cached KV: everything, one chunk id's entries, or (with `tenant`) only that
        tenant's entries (all of them, or of one chunk id) with its kept conversations and
        Cache-Craft variants. Returns how many store entries were removed."""
        with self._lock:
            if chunk_id is None:
                self.variants.clear(tenant)
                self.conversations.clear(tenant)
                if tenant is None:
                    self.writer.variants_loaded = True  # the files are gone too
            return self.store.delete(chunk_id, tenant)

    def close(self) -> None:
        self.scheduler.close()
        self.precompute.close()
        self.store.flush()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
