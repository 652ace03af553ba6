"""The engine object: model runner + tokenizer + chunk store + planner + executor + decode.

It is the only stateful object in the sidecar; everything it hands between stages is plain data.
One sequence is prefilled/decoded at a time (a lock serializes requests); the HTTP layer queues.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engine_sidecar.errors import PromptTooLongError
from engine_sidecar.executor import KVBuffer, PrefillResult, decode_step, fused_prefill
from engine_sidecar.fingerprint import model_fingerprint, token_ids_digest, tokenizer_fingerprint
from engine_sidecar.model.prepare import resolve_model_dir
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.paths import default_cache_dir
from engine_sidecar.plan import FusionPlan, PlanSpan
from engine_sidecar.policies import Policy, ReusePolicy, parse_policy
from engine_sidecar.prompt import AssembledPrompt, PromptBuilder, Segment
from engine_sidecar.reorder import ChunkAccessTable, check_order
from engine_sidecar.sampling import TextAccumulator, choose_token
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
Convention = Literal["isolated", "after-prefix"]
Precompute = Literal["inline", "background"]
DEFAULT_SYSTEM = ChunkedPrompt.model_fields["system"].default


@dataclass
class EngineConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: Path | None = None  # None -> $RAGCACHE_HOME/kv; disk tier off with disk=False
    disk: bool = True
    ram_cache_bytes: int = 2 << 30
    convention: Convention = "isolated"
    precompute: Precompute = "inline"
    threads: int | None = None
    ca_window: int = 1000  # CA-Table sliding window, in requests


class GenerationStream:
    """Iterate for text deltas; `.result` holds the full GenerationResult once iteration ends."""

    def __init__(self, events: Iterator[str | GenerationResult]):
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        for event in self._events:
            if isinstance(event, GenerationResult):
                self.result = event
            elif event:
                yield event


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
        self._lock = threading.RLock()
        self._background: queue.Queue[tuple[Chunk, str, str] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self.eos_ids = self._eos_ids()
        self.access_table = ChunkAccessTable(config.ca_window)

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
        store = ChunkStore(config.ram_cache_bytes, Path(disk_dir) if disk_dir else None, runner.device)
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

    def _key(self, token_ids: tuple[int, ...], tenant: str, context: str) -> CacheKey:
        return CacheKey(self.model_fp, self.tokenizer_fp, token_ids_digest(list(token_ids)), tenant, context)

    def _chunk_context(self, prefix: Segment) -> str:
        if self.config.convention == "after-prefix":
            return "after:" + token_ids_digest(list(prefix.token_ids))
        return "isolated"

    @property
    def max_context(self) -> int:
        return self.runner.config.max_position_embeddings

    # --- precompute --------------------------------------------------------------------------
    def _compute_chunk_kv(self, chunk_seg: Segment, prefix: Segment, tenant: str) -> ChunkKV:
        spans: list[PlanSpan] = []
        start = 0
        if self.config.convention == "after-prefix":
            cached = self.store.get(self._key(prefix.token_ids, tenant, "exact"))
            spans.append(PlanSpan("prefix", 0, prefix.token_ids, "exact" if cached else "fresh", cached))
            start = len(prefix.token_ids)
        spans.append(PlanSpan("chunk", start, chunk_seg.token_ids, "fresh", chunk_id=chunk_seg.chunk_id))
        result = fused_prefill(self.runner, FusionPlan(spans, "precompute"), ReusePolicy(), need_logits=False)
        end = start + len(chunk_seg.token_ids)
        if self.config.convention == "after-prefix" and spans[0].cached is None:
            self._store_span(result.kv, spans[0], tenant, "exact")
        return ChunkKV(result.kv.keys_pre[:, start:end].clone(), result.kv.values[:, start:end].clone(),
                       torch.tensor(chunk_seg.token_ids, dtype=torch.long), chunk_seg.chunk_id, tenant)

    def _store_span(self, kv: KVBuffer, span: PlanSpan, tenant: str, context: str) -> None:
        entry = ChunkKV(kv.keys_pre[:, span.start : span.end].clone(), kv.values[:, span.start : span.end].clone(),
                        torch.tensor(span.token_ids, dtype=torch.long), span.chunk_id, tenant)
        self.store.put(self._key(span.token_ids, tenant, context), entry)

    def _check_chunk_fits(self, seg: Segment, index: int | None = None) -> None:
        if len(seg.token_ids) >= self.max_context:
            where = f"chunks[{index}]" if index is not None else f"chunk {seg.chunk_id}"
            raise PromptTooLongError(
                f"{where} has {len(seg.token_ids)} tokens, more than the model's context window "
                f"({self.max_context}); split it into smaller chunks"
            )

    def warm(self, chunks: list[Chunk | str], system: str | None = None, tenant: str = "") -> int:
        """Precompute and store KV for chunks not cached yet; returns how many were computed."""
        prefix = self.builder.prefix_segment(system if system is not None else DEFAULT_SYSTEM)
        computed = 0
        for i, raw in enumerate(chunks):
            chunk = Chunk(text=raw) if isinstance(raw, str) else raw
            seg = self.builder.chunk_segment(chunk)
            self._check_chunk_fits(seg, i)
            key = self._key(seg.token_ids, tenant, self._chunk_context(prefix))
            with self._lock:
                if self.store.contains(key):
                    continue
                self.store.put(key, self._compute_chunk_kv(seg, prefix, tenant))
            computed += 1
        return computed

    def _background_loop(self) -> None:
        while True:
            item = self._background.get()
            try:
                if item is None:
                    return
                chunk, system, tenant = item
                self.warm([chunk], system=system, tenant=tenant)
            except Exception:  # a failed warm only means a later miss
                log.exception("background precompute failed")
            finally:
                self._background.task_done()

    def _enqueue_background(self, chunk: Chunk, system: str, tenant: str) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._background_loop, name="ragcache-precompute", daemon=True)
            self._worker.start()
        self._background.put((chunk, system, tenant))

    def wait_background(self) -> None:
        """Block until background precompute work queued so far is stored."""
        self._background.join()

    # --- planning ----------------------------------------------------------------------------
    def _plan(self, assembled: AssembledPrompt, prompt: ChunkedPrompt | None, policy: Policy,
              tenant: str) -> tuple[FusionPlan, int, int, list[Chunk]]:
        spans: list[PlanSpan] = []
        hits = misses = 0
        to_background: list[Chunk] = []
        prefix = assembled.segments[0] if assembled.segments[0].kind == "prefix" else None
        chunks_by_id = {c.id: c for c in (prompt.chunks if prompt else [])}
        pos = 0
        for seg in assembled.segments:
            span = PlanSpan(seg.kind, pos, seg.token_ids, "fresh", chunk_id=seg.chunk_id)
            if policy.uses_cache and seg.kind == "prefix":
                span.cached = self.store.get(self._key(seg.token_ids, tenant, "exact"))
                span.mode = "exact" if span.cached is not None else "fresh"
            elif policy.uses_cache and seg.kind == "chunk" and prefix is not None:
                key = self._key(seg.token_ids, tenant, self._chunk_context(prefix))
                span.cached = self.store.get(key)
                if span.cached is None and self.config.precompute == "inline":
                    span.cached = self._compute_chunk_kv(seg, prefix, tenant)
                    self.store.put(key, span.cached)
                    misses += 1
                elif span.cached is None:
                    misses += 1
                    chunk = chunks_by_id.get(seg.chunk_id)
                    if chunk is not None:
                        to_background.append(chunk)
                else:
                    hits += 1
                if span.cached is not None:
                    # After-prefix KV of the first chunk was computed at exactly these positions.
                    exact = self.config.convention == "after-prefix" and pos == len(prefix.token_ids)
                    span.mode = "exact" if exact else "fuse"
            spans.append(span)
            pos += len(seg.token_ids)
        return FusionPlan(spans, policy.name), hits, misses, to_background

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                 policy: str | Policy = "cacheblend", tenant: str = "", order: str = "preserve") -> GenerationResult:
        """Answer a chunk-structured prompt. `policy` picks the recompute strategy, `order`
        ('preserve' or 'frequency') whether chunks are re-sorted by the CA-Table, `tenant` salts
        every cache key so tenants never share KV."""
        stream = self.stream(prompt, sampling, policy, tenant, order)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
               policy: str | Policy = "cacheblend", tenant: str = "", order: str = "preserve") -> GenerationStream:
        prompt = prompt if isinstance(prompt, ChunkedPrompt) else ChunkedPrompt.model_validate(prompt)
        check_order(order)
        self.access_table.record([c.id or "" for c in prompt.chunks])
        if order == "frequency" and prompt.chunks:
            prompt = prompt.model_copy(update={"chunks": self.access_table.sort(prompt.chunks, lambda c: c.id)})
        sampling = sampling if isinstance(sampling, SamplingParams) else SamplingParams.model_validate(sampling or {})
        pol = policy if isinstance(policy, Policy) else parse_policy(policy)
        return GenerationStream(self._run(prompt, None, sampling, pol, tenant))

    def prefill_logits(self, prompt: ChunkedPrompt | dict, policy: str | Policy = "cacheblend",
                       tenant: str = "") -> tuple[torch.Tensor, GenerationStats]:
        """Next-token logits after the prompt, and the prefill's stats (for fidelity checks)."""
        prompt = prompt if isinstance(prompt, ChunkedPrompt) else ChunkedPrompt.model_validate(prompt)
        pol = policy if isinstance(policy, Policy) else parse_policy(policy)
        t0 = time.perf_counter()
        assembled = self.builder.build(prompt)
        with self._lock:
            plan, hits, misses, _ = self._plan(assembled, prompt, pol, tenant)
            result = fused_prefill(self.runner, plan, pol)
            self._learn(plan, result, tenant)
        assert result.logits is not None
        return result.logits, self._stats(plan, result, hits, misses, time.perf_counter() - t0, pol, {})

    def stream_chat(self, messages: list[dict[str, str]], sampling: SamplingParams | dict | None = None,
                    tenant: str = "") -> GenerationStream:
        """A plain chat completion (no chunks): the whole prompt is computed fresh."""
        sampling = sampling if isinstance(sampling, SamplingParams) else SamplingParams.model_validate(sampling or {})
        return GenerationStream(self._run(None, messages, sampling, parse_policy("full"), tenant))

    def _run(self, prompt: ChunkedPrompt | None, messages: list[dict[str, str]] | None,
             sampling: SamplingParams, policy: Policy, tenant: str) -> Iterator[str | GenerationResult]:
        t0 = time.perf_counter()
        times: dict[str, float] = {}
        assembled = self.builder.build(prompt) if prompt is not None else self.builder.build_chat(messages or [])
        for i, seg in enumerate(s for s in assembled.segments if s.kind == "chunk"):
            self._check_chunk_fits(seg, i)
        total = len(assembled)
        if total + sampling.max_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt has {total} tokens and max_tokens is {sampling.max_tokens}: together more than the "
                f"model's context window ({self.max_context}); send fewer or shorter chunks or lower max_tokens"
            )
        times["tokenize_s"] = time.perf_counter() - t0
        with self._lock:
            t1 = time.perf_counter()
            plan, hits, misses, to_background = self._plan(assembled, prompt, policy, tenant)
            times["plan_s"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            result = fused_prefill(self.runner, plan, policy, capacity=total + sampling.max_tokens)
            times["prefill_s"] = time.perf_counter() - t2
            self._learn(plan, result, tenant)
            generator = None
            if sampling.seed is not None:
                generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
            logits = result.logits
            assert logits is not None
            token = choose_token(logits, sampling, generator)
            ttft = time.perf_counter() - t0
            stats = self._stats(plan, result, hits, misses, ttft, policy, times)
            text = TextAccumulator(self.builder.decode, sampling.stop)
            stop_ids = self.eos_ids | set(sampling.stop_token_ids)
            generated: list[int] = []
            finish = "length"
            t3 = time.perf_counter()
            while True:
                if token in stop_ids:
                    finish = "stop"
                    break
                generated.append(token)
                delta = text.add(token)
                if delta:
                    yield delta
                if text.stopped:
                    finish = "stop"
                    break
                if len(generated) >= sampling.max_tokens:
                    break
                token = choose_token(decode_step(self.runner, result.kv, token), sampling, generator)
            tail = text.finish()
            if tail:
                yield tail
            times["decode_s"] = time.perf_counter() - t3
        if prompt is not None:
            for chunk in to_background:
                self._enqueue_background(chunk, prompt.system, tenant)
        stats.decode_tokens = len(generated)
        stats.stage_times = times
        yield GenerationResult(text=text.text, token_ids=generated, finish_reason=finish, stats=stats)

    def _learn(self, plan: FusionPlan, result: PrefillResult, tenant: str) -> None:
        """Keep what this request computed exactly: the template prefix, and under the
        after-prefix convention the first chunk when it was computed fresh right after it."""
        if not plan.spans or plan.policy == "full":
            return
        first = plan.spans[0]
        if first.kind == "prefix" and first.mode == "fresh":
            self._store_span(result.kv, first, tenant, "exact")
            if self.config.convention == "after-prefix" and len(plan.spans) > 1:
                nxt = plan.spans[1]
                if nxt.kind == "chunk" and nxt.mode == "fresh":
                    self._store_span(result.kv, nxt, tenant, "after:" + token_ids_digest(list(first.token_ids)))

    def _stats(self, plan: FusionPlan, result: PrefillResult, hits: int, misses: int, ttft: float,
               policy: Policy, times: dict[str, float]) -> GenerationStats:
        total = plan.num_tokens
        cached = sum(len(s) for s in plan.spans if s.mode != "fresh")
        fresh = total - cached
        recomputed = result.fused_tokens_recomputed
        return GenerationStats(
            ttft_s=ttft,
            prefill_tokens_total=total,
            tokens_reused=cached - recomputed,
            tokens_recomputed=recomputed,
            tokens_computed_fresh=fresh,
            chunk_hits=hits,
            chunk_misses=misses,
            computed_fraction=result.token_layers_computed / max(1, total * self.runner.num_layers),
            policy=policy.name,
            stage_times=times,
            plan=plan.describe(),
        )

    # --- housekeeping ------------------------------------------------------------------------
    def clear_cache(self, chunk_id: str | None = None) -> int:
        with self._lock:
            return self.store.delete(chunk_id)

    def close(self) -> None:
        if self._worker is not None:
            self._background.put(None)
            self._worker.join(timeout=30)
            self._worker = None
        self.store.flush()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
