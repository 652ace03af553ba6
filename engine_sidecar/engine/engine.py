"""The engine object: model runner + tokenizer + chunk store + planner + executor + decode.

It is the only stateful object in the sidecar; everything it hands between stages is plain data.
Generation requests become Sequences that the Scheduler serves in batches (one prefill or one
batched decode step at a time, under the engine's lock); warm-ups, clears and fidelity probes
take the same lock between steps.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine_sidecar.engine.eos import eos_token_ids
from engine_sidecar.engine.prefill_stage import PrefillStage
from engine_sidecar.engine.probes import FidelityProbes
from engine_sidecar.engine.request_prep import RequestPreparer
from engine_sidecar.engine.scheduler import Scheduler
from engine_sidecar.engine.sequence import GenerationStream, Sequence
from engine_sidecar.engine.sequence_steps import SequenceSteps
from engine_sidecar.engine.split_prefill import SplitPrefill
from engine_sidecar.engine.step import PrefillStep
from engine_sidecar.engine.verify import FirstTokenVerifier
from engine_sidecar.engine.warm import Pool, WarmReport, warm_chunks
from engine_sidecar.engine_config import EngineConfig
from engine_sidecar.execution.batched_decode import decode_batch
from engine_sidecar.execution.cachecraft import VariantIndex
from engine_sidecar.execution.calibration import resolve as fused_temperatures
from engine_sidecar.execution.costs import CostMeter
from engine_sidecar.execution.decode_graphs import decode_graphs
from engine_sidecar.execution.kernel_warmup import warm_kernels
from engine_sidecar.execution.kv_pool import KVPool
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import Policy, parse_policy
from engine_sidecar.execution.prefill_graphs import load_first_layers, prefill_graphs
from engine_sidecar.model.prepare import resolve_model_dir
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.paths import default_cache_dir
from engine_sidecar.request.fingerprint import model_fingerprint, tokenizer_fingerprint, weights_fingerprint
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.request.prompt import PromptBuilder
from engine_sidecar.request.reorder import ChunkAccessTable
from engine_sidecar.reuse.commit import ReuseWriter
from engine_sidecar.reuse.conversation import ConversationStore
from engine_sidecar.reuse.cptree import CPTree
from engine_sidecar.reuse.plan_stage import PlanStage
from engine_sidecar.reuse.planner import PlannedRequest
from engine_sidecar.reuse.precompute import Precomputer
from engine_sidecar.store.chunk_store import ChunkStore
from engine_sidecar.store.redis_tier import RedisTier
from ragcache_integrations.policy_registry import DEFAULT_POLICY
from ragcache_integrations.types import (
    Chunk,
    ChunkedPrompt,
    GenerationResult,
    GenerationStats,
    SamplingParams,
)

log = logging.getLogger("ragcache.engine")


class Engine:
    def __init__(self, runner: ModelRunner, builder: PromptBuilder, store: ChunkStore, config: EngineConfig,
                 model_dir: Path):
        self.runner, self.builder, self.store, self.config, self.model_dir = runner, builder, store, config, model_dir
        self.model_fp = model_fingerprint(model_dir, runner.dtype)
        self.tokenizer_fp = tokenizer_fingerprint(model_dir, builder.chat_template)
        self.keys = KeyFactory(self.model_fp, self.tokenizer_fp, config.reuse.convention)
        self._lock = threading.RLock()
        self.access_table = ChunkAccessTable(config.reuse.ca_window)
        talks = config.conversations
        self.conversations = ConversationStore(talks.ttl_s, talks.max_tokens, talks.max_count, talks.ram_bytes)
        self.variants = VariantIndex(config.reuse.cachecraft_variants_per_chunk, config.reuse.cachecraft_max_chunks)
        self.costs = CostMeter()
        self.prefill_stage = PrefillStage(runner, store, self.costs,
                                          prefill_graphs(runner, config.batching.prefill_graphs, self.max_context))
        store.on_disk_load = lambda seconds, tokens: self.costs.observe_load("disk", seconds, tokens)
        store.on_redis_load = lambda seconds, tokens: self.costs.observe_load("redis", seconds, tokens)
        self.cptree = CPTree(lambda node: self.store.contains(self.keys.for_node(node)),
                            config.reuse.promote_threshold)
        self.writer = ReuseWriter(store, self.keys, self.cptree, self.variants)
        self.precompute = Precomputer(runner, store, self.keys, self.writer, self._lock)
        self.prep = RequestPreparer(builder, self.access_table, store, self.keys, self.max_context,
                                    fused_temperatures(config.reuse.fused_temperature, weights_fingerprint(model_dir)),
                                    runner.config.vocab_size)
        self.planning = PlanStage(builder, self.keys, store, self.cptree, self.variants, self.conversations,
                                  self.access_table, self.writer, self.precompute, self.costs, config)
        self.step = PrefillStep(self.planning, self.prefill_stage, self.writer)
        # on a GPU torch's caching allocator already recycles device memory
        self.kv_pool = KVPool(runner, config.batching.kv_bytes, config.batching.max_batch) \
            if runner.device.type == "cpu" else None
        self.probes = FidelityProbes(runner, builder, self.prep, self._lock, self.step, config.reuse.convention,
                                     self.kv_pool)
        self.split = SplitPrefill(runner, self.prep, self.step, self._lock)  # vLLM connector
        c = runner.config
        kv_row_bytes = 3 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=runner.dtype).element_size()
        self.steps = SequenceSteps(self.step, runner, builder.decode,
                                   eos_token_ids(runner.config.eos_token_ids, builder.tokenizer), self.max_context,
                                   config.reuse.convention, self.conversations, self.precompute, self.kv_pool,
                                   FirstTokenVerifier(runner, config.reuse.verify_fraction))
        self.scheduler = Scheduler(functools.partial(decode_batch, runner), self._lock, self.steps,
                                   config.batching.max_batch,
                                   max(1, config.batching.kv_bytes // kv_row_bytes),
                                   decode_graphs(runner, config.batching, self.max_context),
                                   prefill_budget_tokens=config.batching.prefill_tokens)
        self._close_at_exit = _closer(weakref.ref(self))
        atexit.register(self._close_at_exit)
        weakref.finalize(self, atexit.unregister, self._close_at_exit)  # collected unclosed: nothing to do at exit

    @classmethod
    def from_pretrained(cls, model: str | Path = "default", device: str = "auto", dtype: str = "auto",
                        **options) -> Engine:
        config = EngineConfig.from_options(model=str(model), device=device, dtype=dtype, **options)
        if config.threads:
            torch.set_num_threads(config.threads)
        model_dir = resolve_model_dir(config.model)
        runner = ModelRunner.load(model_dir, device=device, dtype=dtype)
        if runner.device.type == "cuda":
            # the Triton kernels compile now, not on the first requests that meet each of them
            log.info("GPU kernels compiled and run once in %.1f s", warm_kernels(runner))
        engine = cls.from_runner(runner, model_dir, config)
        graphs = engine.prefill_stage.graphs
        if graphs is not None:
            log.info("%d prefill graphs captured in %.1f s", *graphs.capture_all(load_first_layers(runner.num_layers)))
        return engine

    @classmethod
    def from_runner(cls, runner: ModelRunner, model_dir: Path, config: EngineConfig) -> Engine:
        """An engine around a runner already built (from_pretrained's loaded weights, or the GPU
        benchmark's random ones); `model_dir` gives the tokenizer, template and fingerprints."""
        builder = PromptBuilder.load(model_dir)
        tiers = config.store
        disk_dir = (tiers.cache_dir or default_cache_dir()) if tiers.disk else None
        redis = RedisTier(tiers.redis_url, ttl_s=tiers.redis_ttl_s) if tiers.redis_url else None
        # on a CPU the first tier is host RAM already: a host tier behind it would hold copies twice
        host_bytes = tiers.host_bytes if runner.device.type == "cuda" else 0
        store = ChunkStore(tiers.ram_bytes, Path(disk_dir) if disk_dir else None, runner.device, tiers.disk_bytes,
                           redis, host_bytes)
        return cls(runner, builder, store, config, model_dir)

    # --- identity ----------------------------------------------------------------------------
    @property
    def eos_ids(self) -> set[int]:
        """The token ids that end an answer (the scheduler's sequences stop on them)."""
        return self.steps.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.steps.eos_ids = ids

    @property
    def max_context(self) -> int:
        return self.runner.config.max_position_embeddings

    # --- precompute --------------------------------------------------------------------------
    def warm(self, chunks: list[Chunk | str], system: str | None = None, tenant: str = "", neighbours: int = 0,
             pool: Pool = None) -> int:
        """Precompute KV for chunks not cached yet (alone, or after `neighbours` passages: warm.py);
        how many were computed."""
        return self.warm_report(chunks, system, tenant, neighbours, pool).computed

    def warm_report(self, chunks: list[Chunk | str], system: str | None = None, tenant: str = "",
                    neighbours: int | None = None, pool: Pool = None) -> WarmReport:
        """`warm` with what it did and cost; `neighbours` None: two where the pool (default: these
        chunks) has passages to choose from, as the server and the `ragcache warm` command do."""
        return warm_chunks(self.builder, self.prep, self.precompute, chunks, system, tenant, neighbours, pool)

    def wait_background(self) -> None:
        """Block until background precompute work queued so far is stored."""
        self.precompute.wait_background()

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
                 policy: str | Policy = DEFAULT_POLICY, tenant: str = "", order: str = "preserve") -> GenerationResult:
        """Answer a chunk-structured prompt. `policy` picks the recompute strategy, `order`
        ('preserve', 'frequency', 'hits-first' or 'misses-first') whether chunks are re-sorted by
        the CA-Table or with the chunks the cache holds first or last, `tenant` salts
        every cache key so tenants never share KV. With `prompt.conversation_id` the next turn
        continues from this one's KV."""
        stream = self.stream(prompt, sampling, policy, tenant, order)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: ChunkedPrompt | dict, sampling: SamplingParams | dict | None = None,
               policy: str | Policy = DEFAULT_POLICY, tenant: str = "", order: str = "preserve") -> GenerationStream:
        prompt, sampling, pol = self.prep.prepare(prompt, sampling, policy, order, tenant)
        return GenerationStream(self._submit(prompt, sampling, pol, tenant))

    def prefill_logits(self, prompt: ChunkedPrompt | dict, policy: str | Policy = DEFAULT_POLICY,
                       tenant: str = "", order: str = "preserve") -> tuple[torch.Tensor, GenerationStats]:
        """Next-token logits after the prompt, and the prefill's stats (probes.py)."""
        return self.probes.prefill_logits(prompt, policy, tenant, order)

    def teacher_forced_logits(self, prompt: ChunkedPrompt | dict, continuation: list[int],
                              policy: str | Policy = DEFAULT_POLICY, tenant: str = "",
                              order: str = "preserve") -> tuple[torch.Tensor, GenerationStats]:
        """Logits after the prompt, then after each token of `continuation` fed back (probes.py)."""
        return self.probes.teacher_forced_logits(prompt, continuation, policy, tenant, order)

    def measure_full_prefill(self, prompt: ChunkedPrompt | dict) -> float:
        """Seconds an ordinary full prefill of this prompt takes now, touching no cache (probes.py)."""
        return self.probes.measure_full_prefill(prompt)

    def stream_chat(self, messages: list[dict[str, str]], sampling: SamplingParams | dict | None = None,
                    tenant: str = "") -> GenerationStream:
        """A plain chat completion (no chunks): the whole prompt is computed fresh."""
        sampling = sampling if isinstance(sampling, SamplingParams) else SamplingParams.model_validate(sampling or {})
        self.prep.check_sampling(sampling)
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
        """Stop the scheduler and the precompute worker (requests still waiting fail), finish the
        store's queued writes and end its writer threads. Also run at interpreter exit for an
        engine left open: a daemon thread still inside torch when the interpreter tears down
        aborts the process, and the writes it had queued would be cut."""
        atexit.unregister(self._close_at_exit)
        self.scheduler.close()
        self.precompute.close()
        self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _closer(engine: weakref.ReferenceType[Engine]) -> Callable[[], None]:
    """What atexit runs for one engine: close it if it is still open. It holds the engine weakly,
    so registering it keeps no engine alive."""
    def close_if_alive() -> None:
        alive = engine()
        if alive is not None:
            alive.close()

    return close_if_alive
