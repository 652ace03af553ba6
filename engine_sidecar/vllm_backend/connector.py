"""ragcache as a vLLM v1 KV connector: vLLM schedules, batches, attends and decodes; ragcache
supplies the KV of the chunks it holds and learns the KV vLLM computes for the others.

Load it with `--kv-transfer-config '{"kv_connector": "RagcacheConnector", "kv_role": "kv_both",
"kv_connector_module_path": "engine_sidecar.vllm_backend.connector"}'` (or `connector_config()`),
and send each request its chunk structure as `kv_transfer_params` (params.request_params) with
the token ids ragcache lays out for it as the prompt (chunks in the order to serve: the ones
likely stored first, e.g. the CA-Table's order, so misses come after the hits).

Scheduler side: for a request with ragcache params whose prompt is exactly ragcache's layout,
the whole blocks up to the end of its leading run of stored chunks are claimed as external KV
(beyond vLLM's own prefix-cache hit); with `supply="all"`, up to the end of its last chunk, stored
or not (ragcache computes the new ones in place, as its own engine does). Which chunks are
stored, the scheduler learns from the workers (worker metadata after each step); a chunk gone
since is computed in place by ragcache, so residency only decides speed, never correctness.
Worker side: before the forward pass, ragcache plans the prompt and computes the leading spans
(its stored chunks fused by the policy) and the claimed rows are written into vLLM's paged cache
with vLLM's own cache-write op; vLLM computes the misses and the question in context. When the
request's prompt is complete in the cache, ragcache reads the prompt's KV back (the layout inside
a block is learned once from the write op itself), undoes the rotation and commits what was new:
misses in place with their context, exactly as its own engine would. A load that fails is
reported through `get_block_ids_with_load_errors` and vLLM recomputes those blocks.
`request_finished` returns ragcache's stats for the request in `kv_transfer_params`.
CPU only so far (vLLM's CPU attention backend)."""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from engine_sidecar.request.fingerprint import token_ids_digest
from engine_sidecar.vllm_backend.params import (
    ConnectorParams,
    chunks_end,
    claimable_tokens,
    connector_params,
    leading_resident_end,
    slot_mapping,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from engine_sidecar.engine.split_prefill import PrefixRun

log = logging.getLogger("ragcache.vllm")

# the connector API is marked experimental and the CPU cache layout is backend-internal
SUPPORTED_VLLM = ("0.32.",)
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def check_vllm_version(version: str = vllm.__version__) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"ragcache's vLLM connector supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
                           f"this is vLLM {version}: install the tested one with `make vllm-env`")


def residency_key(tenant: str, chunk_token_ids: tuple[int, ...] | list[int]) -> str:
    return f"{tenant}\x00{token_ids_digest(chunk_token_ids)}"


@dataclass
class LoadRequest:
    """One request's KV to write before a forward pass: token positions [start, start + count)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    count: int
    params: dict[str, Any]


@dataclass
class SaveRequest:
    """A request whose prompt is complete in vLLM's cache after this step: ragcache learns from it."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    params: dict[str, Any]


@dataclass
class RagcacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)


@dataclass
class RagcacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler after a step: chunks now stored, and finished requests' stats."""

    resident: set[str] = field(default_factory=set)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, RagcacheWorkerMetadata):
            self.resident |= other.resident
            self.stats.update(other.stats)
        return self


@dataclass
class _Tracked:
    """Scheduler-side state of a request with ragcache params, until its prompt is learned."""

    params: dict[str, Any]
    token_ids: list[int]
    external: int = 0
    blocks: list[int] = field(default_factory=list)
    saved: bool = False


class CacheLayout:
    """Where vLLM's CPU cache-write op puts token t, head h, dimension d inside a block (it
    differs by ISA and dtype, and is not an API), learned by writing coded values into a scratch
    block: key_offsets / value_offsets [block_size, Hkv * D] index a block's flat storage."""

    DIGIT = 128  # exact in bf16

    def __init__(self, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, isa: str):
        self.block_size = block_size
        count = block_size * kv_heads * head_dim
        codes = torch.arange(count).view(block_size, kv_heads, head_dim)
        scratch = torch.empty(1, kv_heads, block_size, 2 * head_dim, dtype=dtype)
        slots = torch.arange(block_size, dtype=torch.long)
        offsets = {}
        for part in ("key", "value"):
            found = torch.zeros(scratch.numel(), dtype=torch.long)
            written = torch.zeros(scratch.numel(), dtype=torch.bool)
            for power in range(3):
                digit = (codes // self.DIGIT**power % self.DIGIT).to(dtype)
                other = torch.full_like(digit, -2)
                scratch.fill_(-1)
                keys, values = (digit, other) if part == "key" else (other, digit)
                write_block(scratch, keys, values, slots, isa)
                flat = scratch.view(-1).float()
                mask = flat >= 0
                written |= mask
                found[mask] += flat[mask].long() * self.DIGIT**power
            where = written.nonzero().squeeze(1)
            if where.numel() != count:
                raise RuntimeError(f"vLLM's cache layout not understood ({part}s: {where.numel()} of {count} cells)")
            index = torch.empty(count, dtype=torch.long)
            index[found[where]] = where
            offsets[part] = index.view(block_size, kv_heads * head_dim)
        self.key_offsets, self.value_offsets = offsets["key"], offsets["value"]

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, Hkv, D] at `slots` of one layer's cache [blocks, Hkv, bs, 2D]."""
        flat = cache.view(cache.shape[0], -1)
        blocks, rows = slots // self.block_size, slots % self.block_size
        shape = (slots.shape[0], cache.shape[1], -1)
        return (flat[blocks[:, None], self.key_offsets[rows]].view(shape),
                flat[blocks[:, None], self.value_offsets[rows]].view(shape))


class RagcacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_vllm_version()
        if vllm_config.device_config.device_type != "cpu":
            raise RuntimeError("ragcache's vLLM connector supports vLLM's CPU backend only so far")
        self.block_size = vllm_config.cache_config.block_size
        self.model_dir = vllm_config.model_config.model
        self.dtype = vllm_config.model_config.dtype
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.ram_cache_bytes = int(float(extra.get("ram_cache_gb", 2.0)) * (1 << 30))
        self.stats_path = extra.get("stats_path")
        self.fused_temperature = extra.get("fused_temperature", "auto")
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._resident: set[str] = set()  # residency keys the workers reported stored
        self._stats: dict[str, dict[str, Any]] = {}
        self._builder: Any = None  # ragcache's prompt layout (tokenizer only)
        # worker side
        self._engine: Any = None  # ragcache's engine, loaded on first use
        self._engine_lock = threading.Lock()
        self._caches: dict[str, torch.Tensor] = {}
        self._isa: dict[str, str] = {}
        self._layouts: dict[str, CacheLayout] = {}
        self._runs: dict[str, tuple[PrefixRun, int]] = {}  # request -> (ragcache's run, rows supplied)
        self._failed_blocks: set[int] = set()
        self._report = RagcacheWorkerMetadata()
        self.supplied_tokens = 0

    # --- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            params = connector_params(request.kv_transfer_params)
        except ValueError as exc:
            log.warning("request %s: ragcache params ignored: %s", request.request_id, exc)
            return 0, False
        if params is None:
            return 0, False
        ids = list(request.prompt_token_ids or [])
        segments = self._layout(params.prompt)
        if [t for s in segments for t in s.token_ids] != ids:
            log.warning("request %s: prompt is not ragcache's layout of its chunks: nothing supplied",
                        request.request_id)
            return 0, False
        self._tracked[request.request_id] = _Tracked(dict(request.kv_transfer_params or {}), ids)
        described = [(s.kind, residency_key(params.tenant, s.token_ids), len(s.token_ids)) for s in segments]
        # supply="all": every chunk, new ones computed in place by ragcache (the client puts them
        # first); vLLM then computes the question alone
        limit = chunks_end(described) if params.supply == "all" else leading_resident_end(described, self._resident)
        return claimable_tokens(len(ids), num_computed_tokens, self.block_size, limit), False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            tracked.external = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RagcacheConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            ids = list(new.prompt_token_ids or [])
            tracked.blocks = list(new.block_ids[0])
            if tracked.external:
                meta.loads.append(LoadRequest(new.req_id, ids, list(tracked.blocks),
                                              new.num_computed_tokens - tracked.external, tracked.external,
                                              tracked.params))
            self._maybe_save(meta, new.req_id, tracked, ids, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.saved:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:  # after preemption: all of its blocks
                    tracked.blocks = list(new_blocks[0])
                else:
                    tracked.blocks.extend(new_blocks[0])
            self._maybe_save(meta, req_id, tracked, tracked.token_ids,
                             cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: RagcacheConnectorMetadata, req_id: str, tracked: _Tracked, ids: list[int],
                    done: int) -> None:
        if not tracked.saved and ids and done >= len(ids):
            tracked.saved = True
            meta.saves.append(SaveRequest(req_id, ids, list(tracked.blocks), tracked.params))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, RagcacheWorkerMetadata):
            self._resident |= report.resident
            # a request that finished in the step that completed its prompt (one output token)
            # was released before its stats arrived: they are dropped, not kept forever
            self._stats.update({k: v for k, v in report.stats.items() if k in self._tracked})

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        stats = self._stats.pop(request.request_id, None)
        return False, ({"ragcache": stats} if stats is not None else None)

    def _layout(self, prompt: Any) -> list[Any]:
        if self._builder is None:
            from engine_sidecar.request.prompt import PromptBuilder

            self._builder = PromptBuilder.load(self.model_dir)
        return list(self._builder.build(prompt).segments)

    # --- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for name, layer in forward_context.no_compile_layers.items():
            if name not in self._isa and getattr(layer, "isa", None) is not None:
                self._isa[name] = layer.isa
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagcacheConnectorMetadata)
        for load in meta.loads:
            try:
                self._load(load)
            except Exception:  # vLLM recomputes what was not written; the request still succeeds
                log.exception("request %s: ragcache KV not supplied; vLLM recomputes it", load.req_id)
                self._failed_blocks.update(_blocks_of(load, self.block_size))

    def _load(self, load: LoadRequest) -> None:
        params = _params(load.params)
        end = load.start + load.count
        run = self._worker_engine().split_prefix(params.prompt, params.policy, params.tenant, upto=end)
        if run.result is None or run.end < end or run.token_ids[:end] != load.token_ids[:end]:
            raise RuntimeError("ragcache's plan does not cover the claimed tokens of this prompt")
        slots = torch.tensor(slot_mapping(load.block_ids, self.block_size, load.start, end), dtype=torch.long)
        for name, cache in self._caches.items():
            found = _LAYER_INDEX.search(name)
            if found is None:
                continue
            index = int(found.group(1))
            write_block(_one(cache), run.result.kv.keys[index, load.start : end],
                        run.result.kv.values[index, load.start : end], slots, self._isa[name])
        self._runs[load.req_id] = (run, load.count)
        self.supplied_tokens += load.count

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagcacheConnectorMetadata)
        for save in meta.saves:
            try:
                self._learn(save)
            except Exception:  # learning is an optimisation: the request is served either way
                log.exception("request %s: ragcache did not learn this prompt's KV", save.req_id)
            finally:
                self._runs.pop(save.req_id, None)

    def _learn(self, save: SaveRequest) -> None:
        params = _params(save.params)
        engine = self._worker_engine()
        run, supplied = self._runs.get(save.req_id) or (engine.split_prefix(params.prompt, params.policy,
                                                                            params.tenant, upto=0), 0)
        n = len(save.token_ids)
        if run.token_ids != save.token_ids:
            raise RuntimeError("ragcache's layout of this prompt differs from vLLM's tokens")
        slots = torch.tensor(slot_mapping(save.block_ids, self.block_size, 0, n), dtype=torch.long)
        layers = sorted((int(m.group(1)), name) for name in self._caches if (m := _LAYER_INDEX.search(name)))
        keys, values = zip(*(self._layout_for(name).read(_one(self._caches[name]), slots) for _, name in layers),
                           strict=True)
        engine.split_learn(run, torch.stack(keys), torch.stack(values))
        chunks = [s for s in run.planned.plan.spans if s.kind == "chunk"]
        self._report.resident |= {residency_key(params.tenant, s.token_ids) for s in chunks}
        stats = {"supplied_tokens": supplied, "prompt_tokens": n, "chunk_hits": run.chunk_hits,
                 "chunks": len(chunks), "policy": params.policy,
                 "ragcache_token_layers": run.token_layers, "layers": engine.num_layers}
        self._report.stats[save.req_id] = stats
        if self.stats_path:
            with open(self.stats_path, "a", encoding="utf-8") as out:
                out.write(json.dumps({"request_id": save.req_id, **stats}) + "\n")
        log.info("request %s: ragcache supplied %d tokens (policy %s, chunk hits %d, computed %.3f)",
                 save.req_id, supplied, params.policy, run.chunk_hits,
                 run.token_layers / max(1, n * engine.num_layers))

    def _layout_for(self, name: str) -> CacheLayout:
        cache = _one(self._caches[name])
        isa = self._isa[name]
        key = f"{isa}/{cache.dtype}/{tuple(cache.shape[1:])}"
        if key not in self._layouts:
            _, kv_heads, block_size, twice_dim = cache.shape
            self._layouts[key] = CacheLayout(kv_heads, block_size, twice_dim // 2, cache.dtype, isa)
        return self._layouts[key]

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._report.resident and not self._report.stats:
            return None
        report, self._report = self._report, RagcacheWorkerMetadata()
        return report

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _worker_engine(self) -> Any:
        with self._engine_lock:
            if self._engine is None:
                from engine_sidecar.engine.engine import Engine

                dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(self.dtype)
                if dtype is None:
                    raise RuntimeError(f"ragcache's vLLM connector needs float32 or bfloat16 KV, not {self.dtype}")
                self._engine = Engine.from_pretrained(self.model_dir, device="cpu", dtype=dtype, disk=False,
                                                      ram_cache_bytes=self.ram_cache_bytes,
                                                      fused_temperature=self.fused_temperature)
            return self._engine


def _params(raw: dict[str, Any]) -> ConnectorParams:
    params = connector_params(raw)
    assert params is not None
    return params


def _one(cache: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    return cache[0] if isinstance(cache, list) else cache


def _blocks_of(load: LoadRequest, block_size: int) -> set[int]:
    first, last = load.start // block_size, (load.start + load.count - 1) // block_size
    return set(load.block_ids[first : last + 1])


def write_block(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """Rotated keys and values [n, Hkv, D] into one layer's paged cache [blocks, Hkv, bs, 2D] at
    `slots`, with the op vLLM's CPU backend writes its own KV with."""
    num_blocks, kv_heads, block_size, _ = cache.size()
    key_cache, value_cache = cache.view(num_blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys.to(cache.dtype).contiguous(), values.to(cache.dtype).contiguous(),
                                   key_cache, value_cache, slots, isa)
