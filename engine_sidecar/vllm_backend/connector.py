"""ragcache as a vLLM v1 KV connector: vLLM schedules, batches, attends and decodes; ragcache
supplies the prompt's KV.

Load it with `--kv-transfer-config '{"kv_connector": "RagcacheConnector", "kv_role": "kv_both",
"kv_connector_module_path": "engine_sidecar.vllm_backend.connector"}'` (or `connector_config()`),
and send each request its chunk structure as `kv_transfer_params` (params.request_params) with
the token ids ragcache lays out for it as the prompt.

Scheduler side: a request with ragcache params whose prompt is exactly ragcache's layout gets
every whole block before its last token claimed as external KV (vLLM's own prefix-cache hit
first). Worker side: before the forward pass, ragcache's engine prefills the prompt as it would
serve it (the policy's fusion of stored chunks, misses computed in place and stored for later
requests) and the claimed rows of that KV are written into vLLM's paged cache with vLLM's own
cache-write op; vLLM then computes only the rest. A load that fails is reported through
`get_block_ids_with_load_errors`, and vLLM recomputes those blocks itself.

This first version runs ragcache's prefill for the whole claimed prefix, misses included; the
hits-first split (vLLM computing misses in context, ragcache learning their KV back from the
paged cache) is the next step of issue 18. CPU only (vLLM's CPU attention backend)."""

from __future__ import annotations

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
)

from engine_sidecar.vllm_backend.params import claimable_tokens, connector_params, slot_mapping

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("ragcache.vllm")

# the connector API is marked experimental and the CPU cache layout is backend-internal
SUPPORTED_VLLM = ("0.32.",)
MODULE_PATH = "engine_sidecar.vllm_backend.connector"
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def check_vllm_version(version: str = vllm.__version__) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"ragcache's vLLM connector supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
                           f"this is vLLM {version}: install the tested one with `make vllm-env`")


def connector_config(ram_cache_gb: float = 2.0) -> dict[str, Any]:
    """The `kv_transfer_config` that loads this connector."""
    return {"kv_connector": "RagcacheConnector", "kv_role": "kv_both", "kv_connector_module_path": MODULE_PATH,
            "kv_connector_extra_config": {"ram_cache_gb": ram_cache_gb}}


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
class RagcacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)


class RagcacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_vllm_version()
        if vllm_config.device_config.device_type != "cpu":
            raise RuntimeError("ragcache's vLLM connector supports vLLM's CPU backend only so far (issue 18)")
        self.block_size = vllm_config.cache_config.block_size
        self.model_dir = vllm_config.model_config.model
        self.dtype = vllm_config.model_config.dtype
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.ram_cache_bytes = int(float(extra.get("ram_cache_gb", 2.0)) * (1 << 30))
        self._pending: dict[str, tuple[Request, int]] = {}  # scheduler: claimed, awaiting blocks
        self._builder: Any = None  # scheduler: ragcache's prompt layout (tokenizer only)
        self._engine: Any = None  # worker: ragcache's engine, loaded on first use
        self._engine_lock = threading.Lock()
        self._failed_blocks: set[int] = set()
        self.supplied_tokens = 0  # worker: rows written into vLLM's cache so far

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
        if self._layout(params.prompt) != ids:
            log.warning("request %s: prompt is not ragcache's layout of its chunks: nothing supplied",
                        request.request_id)
            return 0, False
        return claimable_tokens(len(ids), num_computed_tokens, self.block_size), False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._pending[request.request_id] = (request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RagcacheConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new.req_id, None)
            if pending is None:
                continue
            request, count = pending
            meta.loads.append(LoadRequest(new.req_id, list(new.prompt_token_ids or []), list(new.block_ids[0]),
                                          new.num_computed_tokens - count, count,
                                          dict(request.kv_transfer_params or {})))
        # a claimed request preempted before its first step is claimed again when rescheduled
        self._pending.clear()
        return meta

    def _layout(self, prompt: Any) -> list[int]:
        if self._builder is None:
            from engine_sidecar.prompt import PromptBuilder

            self._builder = PromptBuilder.load(self.model_dir)
        return list(self._builder.build(prompt).token_ids)

    # --- worker side --------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagcacheConnectorMetadata)
        for load in meta.loads:
            try:
                self._load(load, forward_context)
            except Exception:  # vLLM recomputes what was not written; the request still succeeds
                log.exception("request %s: ragcache KV not supplied; vLLM recomputes it", load.req_id)
                self._failed_blocks.update(_blocks_of(load, self.block_size))

    def _load(self, load: LoadRequest, forward_context: ForwardContext) -> None:
        params = connector_params(load.params)
        assert params is not None
        ids, result, stats = self._worker_engine().probes.prefill_kv(params.prompt, params.policy, params.tenant)
        end = load.start + load.count
        if list(ids[:end]) != load.token_ids[:end]:
            raise RuntimeError("ragcache's prefill laid the prompt out differently from the request's tokens")
        slots = torch.tensor(slot_mapping(load.block_ids, self.block_size, load.start, end), dtype=torch.long)
        for name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            found = _LAYER_INDEX.search(name)
            if cache is None or found is None:
                continue
            index = int(found.group(1))
            _write_layer(cache, result.kv.keys[index, load.start:end], result.kv.values[index, load.start:end],
                         slots, layer)
        self.supplied_tokens += load.count
        log.info("request %s: ragcache supplied %d tokens (policy %s, chunk hits %d, computed %.3f)",
                 load.req_id, load.count, params.policy, stats.chunk_hits, stats.computed_fraction)

    def _worker_engine(self) -> Any:
        with self._engine_lock:
            if self._engine is None:
                from engine_sidecar.engine import Engine

                dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(self.dtype)
                if dtype is None:
                    raise RuntimeError(f"ragcache's vLLM connector needs float32 or bfloat16 KV, not {self.dtype}")
                self._engine = Engine.from_pretrained(self.model_dir, device="cpu", dtype=dtype, disk=False,
                                                      ram_cache_bytes=self.ram_cache_bytes)
            return self._engine

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


def _blocks_of(load: LoadRequest, block_size: int) -> set[int]:
    first, last = load.start // block_size, (load.start + load.count - 1) // block_size
    return set(load.block_ids[first : last + 1])


def _write_layer(cache: torch.Tensor | list[torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
                 slots: torch.Tensor, layer: Any) -> None:
    """Rotated keys and values [n, Hkv, D] into one layer's paged cache at `slots`, with the op
    vLLM's CPU backend writes its own KV with (the layout inside a block is the backend's)."""
    if isinstance(cache, list):
        cache = cache[0]
    num_blocks, kv_heads, block_size, _ = cache.size()
    key_cache, value_cache = cache.view(num_blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys.to(cache.dtype).contiguous(), values.to(cache.dtype).contiguous(),
                                   key_cache, value_cache, slots, layer.isa)
