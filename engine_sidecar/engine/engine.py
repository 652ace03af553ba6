"""The engine object: the model runner and tokenizer, the reuse cache (reuse/cache.py: chunk store,
CP-Tree, variants, conversations, CA-Table) and the scheduler.

It is the only stateful object in the sidecar; everything it hands between stages is plain data.
Generation requests become Sequences that the Scheduler serves in steps (prefills within a token
budget, then one batched decode step, under the engine's lock); a sequence's prefill is
sequence_steps.py's `begin`: plan from the cache, prefill, first token, commit. Warm-ups, clears
and fidelity probes take the same lock between steps.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine_sidecar.engine.eos import eos_token_ids
from engine_sidecar.engine.prefill_stage import PrefillStage
from engine_sidecar.engine.probes import FidelityProbes
from engine_sidecar.engine.request_prep import RequestPreparer
from engine_sidecar.engine.scheduler import KVRows, Scheduler
from engine_sidecar.engine.sequence import GenerationStream, Sequence
from engine_sidecar.engine.sequence_steps import SequenceSteps
from engine_sidecar.engine.split_prefill import PrefixRun, SplitPrefill
from engine_sidecar.engine.verify import FirstTokenVerifier
from engine_sidecar.engine.warm import Pool, WarmReport, neighbour_index, warm_chunks
from engine_sidecar.engine_config import BatchingConfig, EngineConfig
from engine_sidecar.errors import InvalidSettingError
from engine_sidecar.execution.batched_decode import decode_batch
from engine_sidecar.execution.block_pool import BlockPool
from engine_sidecar.execution.calibration import resolve as fused_temperatures
from engine_sidecar.execution.decode_graphs import DecodeGraphs, decode_graphs
from engine_sidecar.execution.kernel_warmup import warm_kernels
from engine_sidecar.execution.kv_pool import KVPool
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import Policy, parse_policy
from engine_sidecar.execution.prefill_graphs import PrefillGraphs, load_first_layers, prefill_graphs
from engine_sidecar.model.prepare import resolve_model_dir
from engine_sidecar.model.runner import ModelRunner
from engine_sidecar.paths import default_cache_dir
from engine_sidecar.request.fingerprint import model_fingerprint, tokenizer_fingerprint, weights_fingerprint
from engine_sidecar.request.keys import KeyFactory
from engine_sidecar.request.prompt import PromptBuilder
from engine_sidecar.reuse.cache import ReuseCache
from engine_sidecar.reuse.neighbours import NeighbourIndex
from engine_sidecar.reuse.planner import PlannedRequest
from engine_sidecar.store.chunk_store import ChunkStore, StoreStats
from engine_sidecar.store.entry import ChunkKV
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

# What code outside engine/ may touch on an Engine (tests/project/test_engine_api.py checks every
# tool against it): requests, probes, warm-ups and housekeeping, reads that return plain data,
# and a few named accessors to deep parts for checks and benchmarks, each saying what it is for.
PUBLIC_API = frozenset({
    "from_pretrained", "from_runner", "close",
    "generate", "stream", "stream_chat",
    "prefill_logits", "teacher_forced_logits", "measure_full_prefill",
    "warm", "warm_report", "wait_background", "neighbour_pool", "chunk_kv", "clear_cache",
    "split_prefix", "split_learn",
    "health", "stats", "reset_kv_peaks", "held_chunk_ids", "load_cost_ratio",
    "eos_ids", "max_context", "model_dir", "num_layers", "encode", "decode", "prompt_token_ids",
    "model_runner", "tokenizer", "chunk_store", "settings", "use_prefill_graphs", "decode_graphs",
    "attention_temperatures",
})


@dataclasses.dataclass(frozen=True)
class EngineHealth:
    """What the engine is and whether it still serves (/health, banners): plain values."""

    failure: str | None  # why the scheduler stopped on a fault; None while it serves
    model: str  # the model folder's name
    model_path: str
    device: str  # "cpu" | "cuda"
    dtype: str  # "bfloat16", "float32", ...
    max_context: int
    disk_dir: Path | None  # the disk tier's folder; None without one
    redis_url: str | None  # the Redis tier, its password hidden; None without one


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """One consistent snapshot of what the engine holds (/stats, /metrics)."""

    store: StoreStats
    conversations: int  # kept conversations, all tenants
    cptree_nodes: int
    waiting: int  # sequences queued for the scheduler
    running: int  # sequences it is decoding
    kv_rows: KVRows  # KV rows the running sequences reserve and use, with their peaks
    prefill_pauses: int = 0  # prefills paused between two layers for a decode step, since the engine started
    preemptions: int = 0  # sequences preempted from the KV block pool to be recomputed, since the engine started
    peak_batch: int = 0  # the most sequences one decode step served, since the engine started


def block_pool(runner: ModelRunner, batching: BatchingConfig) -> BlockPool | None:
    """The running requests' KV pool, where `kv_block_size` asks for one: `kv_bytes` of blocks."""
    if not batching.kv_block_size:
        return None
    pool_bytes = 2 * runner.config.num_layers * runner.config.num_kv_heads * runner.config.head_dim \
        * batching.kv_block_size * torch.empty((), dtype=runner.dtype).element_size()
    if batching.kv_bytes < pool_bytes:
        raise InvalidSettingError(f"--kv-block-size {batching.kv_block_size} needs --batch-kv-gb of at least one "
                                  f"block, {pool_bytes} bytes for this model; got {batching.kv_bytes}")
    return BlockPool(runner.config, runner.dtype, runner.device, block_size=batching.kv_block_size,
                     max_bytes=batching.kv_bytes)


class Engine:
    def __init__(self, runner: ModelRunner, builder: PromptBuilder, store: ChunkStore, config: EngineConfig,
                 model_dir: Path):
        self.runner, self.builder, self.config, self._model_dir = runner, builder, config, model_dir
        self.model_fp = model_fingerprint(model_dir, runner.dtype)
        self.tokenizer_fp = tokenizer_fingerprint(model_dir, builder.chat_template)
        self._lock = threading.RLock()
        keys = KeyFactory(self.model_fp, self.tokenizer_fp, config.reuse.convention)
        self.cache = ReuseCache(runner, builder, store, keys, config, self._lock)
        self.prefill_stage = PrefillStage(runner, self.cache,
                                          prefill_graphs(runner, config.batching.prefill_graphs, self.max_context))
        self.prep = RequestPreparer(builder, self.cache.access_table, store, keys, self.max_context,
                                    fused_temperatures(config.reuse.fused_temperature, weights_fingerprint(model_dir)),
                                    runner.config.vocab_size)
        # on a GPU torch's caching allocator already recycles device memory
        self.kv_pool = KVPool(runner, config.batching.kv_bytes, config.batching.max_batch) \
            if runner.device.type == "cpu" else None
        self.probes = FidelityProbes(runner, builder, self.prep, self._lock, self.cache, self.prefill_stage,
                                     config.reuse.convention, self.kv_pool)
        self.split = SplitPrefill(runner, self.prep, self.cache, self.prefill_stage, self._lock)  # vLLM connector
        c = runner.config
        kv_row_bytes = 3 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=runner.dtype).element_size()
        self.blocks = block_pool(runner, config.batching)
        self.steps = SequenceSteps(self.cache, self.prefill_stage, runner, builder.decode,
                                   eos_token_ids(runner.config.eos_token_ids, builder.tokenizer),
                                   config.reuse.convention, self.kv_pool,
                                   FirstTokenVerifier(runner, config.reuse.verify_fraction), self.blocks)
        self.scheduler = Scheduler(functools.partial(decode_batch, runner), self._lock, self.steps,
                                   config.batching.max_batch,
                                   max(1, config.batching.kv_bytes // kv_row_bytes),
                                   decode_graphs(runner, config.batching, self.max_context),
                                   prefill_budget_tokens=config.batching.prefill_token_budget, blocks=self.blocks,
                                   num_layers=runner.num_layers)
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

    @property
    def model_dir(self) -> Path:
        """The model's folder: weights, tokenizer and chat template."""
        return self._model_dir

    @property
    def num_layers(self) -> int:
        return self.runner.num_layers

    def health(self) -> EngineHealth:
        """What the engine runs and whether its scheduler still serves. Takes no lock: /health
        answers while a long step runs, and every value read is set once or swapped whole."""
        store = self.cache.store
        return EngineHealth(failure=self.scheduler.failure, model=self._model_dir.name, model_path=str(self._model_dir),
                            device=self.runner.device.type, dtype=str(self.runner.dtype).removeprefix("torch."),
                            max_context=self.max_context,
                            disk_dir=store.disk.directory if store.disk is not None else None,
                            redis_url=store.redis.shown_url if store.redis is not None else None)

    def stats(self) -> EngineStats:
        """The store's counters, the kept conversations and the CP-Tree's size. Read without the
        engine lock, so /metrics and /v1/cache/stats answer while a long step runs: a read that
        races the stepping thread's writes (a dict changing size, a disk file going away) raises,
        and reading again is enough."""
        def read() -> EngineStats:
            held = self.cache.stats()
            return EngineStats(store=held.store, conversations=held.conversations, cptree_nodes=held.cptree_nodes,
                               waiting=self.scheduler.waiting, running=self.scheduler.running,
                               kv_rows=self.scheduler.kv_rows, prefill_pauses=self.scheduler.prefill_splits,
                               preemptions=self.scheduler.preemptions, peak_batch=self.scheduler.peak_batch)

        for _ in range(3):
            try:
                return read()
            except (RuntimeError, OSError):
                continue
        with self._lock:  # the stepping thread kept winning the race: wait for the step to end
            return read()

    def reset_kv_peaks(self) -> None:
        """Start `stats().kv_rows`' peaks again from what the running sequences hold now."""
        self.scheduler.reset_kv_peaks()

    def held_chunk_ids(self) -> tuple[set[str], set[str]]:
        """Chunk ids whose KV this engine holds in RAM, and those it holds only in a lower tier
        (host RAM, disk): what a replica tells the router. The store's own lock guards its index,
        and the engine's is not taken: a replica asks on its event loop for every request."""
        ram: set[str] = set()
        lower: set[str] = set()
        store = self.cache.store
        for chunk_id, digests in store.chunk_id_index().items():
            (ram if any(d in store.ram for d in digests) else lower).add(chunk_id)
        return ram, lower

    def load_cost_ratio(self, tier: str) -> float | None:
        """Measured per-token cost of loading KV from `tier` ("ram", "disk", "redis") over that
        of computing it; None until both have been seen."""
        return self.cache.load_cost_ratio(tier)

    # --- tokens ------------------------------------------------------------------------------
    def encode(self, text: str) -> tuple[int, ...]:
        """The text's token ids as a passage in a prompt gets them (no special tokens)."""
        return self.builder.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.builder.decode(token_ids)

    def prompt_token_ids(self, prompt: ChunkedPrompt) -> list[int]:
        """The whole prompt's token ids as this engine assembles it (template, chunks, question)."""
        return list(self.builder.build(prompt).token_ids)

    # --- accessors for checks and benchmarks -------------------------------------------------
    def model_runner(self) -> ModelRunner:
        """The loaded model, for checks and benchmarks that run it outside any request (a full
        reference pass, kernel and graph guards); requests go through generate/stream."""
        return self.runner

    def attention_temperatures(self) -> dict[str, float]:
        """The calibrated attention temperature per policy family that a policy without
        `:temp<T>` runs with (empty: none for this model, or `--fused-temperature off`)."""
        return dict(self.prep.temperatures)

    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, for tools that count tokens its own way."""
        return self.builder.tokenizer

    def chunk_store(self) -> ChunkStore:
        """The chunk store and its tiers, for benchmarks that rearrange or empty tiers between
        measurements; serving code reads `stats()` and `health()` instead."""
        return self.cache.store

    def settings(self) -> EngineConfig:
        """The settings the engine reads as it runs: a benchmark may switch a per-request one
        (`store.prefetch`) between measurements."""
        return self.config

    def use_prefill_graphs(self, graphs: PrefillGraphs | None) -> PrefillGraphs | None:
        """Prefill with these CUDA graphs from now on (None: op by op); returns the ones before,
        so a benchmark can compare and put them back."""
        with self._lock:
            before, self.prefill_stage.graphs = self.prefill_stage.graphs, graphs
            return before

    def decode_graphs(self) -> DecodeGraphs | None:
        """The CUDA graphs batched decode replays (their replay and capture counters), if any."""
        return self.scheduler.graphs

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
        return warm_chunks(self.builder, self.prep, self.cache.precompute, chunks, system, tenant, neighbours, pool)

    def neighbour_pool(self, chunks: list[Chunk] | list[str]) -> NeighbourIndex:
        """The pool a warm-up of `chunks` chooses each one's neighbours from (`warm_report`'s `pool`)."""
        return neighbour_index(self.builder, chunks)

    def chunk_kv(self, text: str, tenant: str = "") -> ChunkKV:
        """A passage's KV computed alone after the empty system prompt and stored nowhere: what
        one chunk costs to compute (calibration)."""
        return self.cache.precompute.compute_chunk_kv(self.builder.chunk_segment(Chunk(text=text)),
                                                self.builder.prefix_segment(""), tenant)

    def wait_background(self) -> None:
        """Block until background precompute work queued so far is stored."""
        self.cache.precompute.wait_background()

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

    def split_prefix(self, prompt: ChunkedPrompt | dict, policy: str | Policy, tenant: str, upto: int) -> PrefixRun:
        """A prefill shared with vLLM: ragcache's leading spans, up to token `upto` (split_prefill.py)."""
        return self.split.prefix(prompt, policy, tenant, upto)

    def split_learn(self, run: PrefixRun, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store what ragcache learns from vLLM's KV of a prompt `split_prefix` laid out."""
        self.split.learn(run, keys, values)

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
        full = parse_policy("full")
        seq = Sequence(sampling, full, "", None, PlannedRequest(plan, policy=full), len(assembled), t0)
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
            return self.cache.clear(chunk_id, tenant)

    def close(self) -> None:
        """Stop the scheduler and the precompute worker (requests still waiting fail), finish the
        store's queued writes and end its writer threads. Also run at interpreter exit for an
        engine left open: a daemon thread still inside torch when the interpreter tears down
        aborts the process, and the writes it had queued would be cut."""
        atexit.unregister(self._close_at_exit)
        self.scheduler.close()
        self.cache.close()

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
