"""Layer-by-layer fused prefill over one sequence's KV buffer.

Per layer: the active tokens (chosen by the policy) get q/k/v from their current hidden states;
their pre-RoPE keys and values overwrite the cached ones in the buffer; all keys are rotated to
their global positions (cos/sin computed once per request); the active queries attend over all
keys with a causal-by-position mask; attention output and MLP update only the active tokens.
Tokens not active keep their cached KV, which is what makes reuse cheap.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine_sidecar.execution.fused_temperature import is_tempered, temper_stale_rows
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.plan import FusionPlan
from engine_sidecar.execution.policies import KeptRows, LayerView, Policy, PrefillView, Selection
from engine_sidecar.execution.prefetch import LayerPrefetcher, PrefetchTimes
from engine_sidecar.execution.question_probe import ReusedKV
from engine_sidecar.model.runner import QKV, ModelRunner, RopeTables
from engine_sidecar.store.entry import ChunkKV
from ragcache_kernels import dispatch

if TYPE_CHECKING:
    from engine_sidecar.execution.prefill_graphs import PrefillGraphs


@dataclass
class PrefillResult:
    logits: torch.Tensor | None  # [vocab] for the last prompt token
    kv: KVBuffer
    token_layers_computed: int  # sum over layers of active tokens: the honest compute share
    fused_tokens_recomputed: int  # fused (cached) tokens still recomputed at the last layer
    fused_tokens: int
    load_s: float = 0.0  # copying cached KV (RAM tier) into the buffer
    loaded_tokens: int = 0
    prefetch: PrefetchTimes | None = None  # disk-tier KV read layer by layer during the prefill
    prefetched: list[ChunkKV] = field(default_factory=list)  # those entries, now fully in memory
    stage_s: dict[str, float] = field(default_factory=dict)  # where the time went (StageClock), CPU only
    decisions: dict[str, Any] = field(default_factory=dict)  # what the policy's selection decided


class StageClock:
    """Seconds per stage of one prefill, for the request's stats. Only where ops run on the host
    as they are issued (the CPU): on a GPU a host clock would time kernel launches, and reading
    the device's would need a sync on the request's path, so nothing is recorded there."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cpu"
        self.stages: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        """The time since the previous mark, added to `stage`."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._last
        self._last = now

    def resume(self) -> None:
        """Back from a pause (the prefill was stepped apart): the pause counts in no stage."""
        self._last = time.perf_counter()


@dataclass
class ActiveRows:
    """The tokens that get hidden states on the current layer (a policy may shrink the set between
    layers), with what each layer needs of them."""

    index: torch.Tensor  # [A] rows of the prompt, ascending (device)
    must_keep: torch.Tensor  # [A] bool: rows with no cached KV, which no policy may drop
    hidden: torch.Tensor  # [A, hidden]
    rope: RopeTables  # [A, head_dim] tables at their positions, in the activations' dtype
    must_keep_count: int  # rows `must_keep` marks (never dropped, so fixed for the prefill)

    @classmethod
    def start(cls, index: torch.Tensor, must_keep: torch.Tensor, hidden: torch.Tensor, rope: RopeTables,
              must_keep_count: int) -> ActiveRows:
        # rounded to the activations' dtype once here, as RoPE would on every call: the same values
        return cls(index, must_keep, hidden, rope.take(index).to(hidden.dtype), must_keep_count)

    def shrink(self, kept: torch.Tensor) -> None:
        """Keep the rows at these positions (ascending indices into the active rows)."""
        self.index, self.must_keep, self.hidden = self.index[kept], self.must_keep[kept], self.hidden[kept]
        self.rope = self.rope.take(kept)


def fused_prefill(
    runner: ModelRunner,
    plan: FusionPlan,
    policy: Policy,
    capacity: int | None = None,
    need_logits: bool = True,
    observer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    prefetch_depth: int = 1,
    allocate: Callable[[int], KVBuffer] | None = None,
    graphs: PrefillGraphs | None = None,
) -> PrefillResult:
    """Run the plan whole (`fused_prefill_steps` has the arguments)."""
    steps = fused_prefill_steps(runner, plan, policy, capacity, need_logits, observer, prefetch_depth, allocate,
                                graphs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@torch.inference_mode()
def fused_prefill_steps(
    runner: ModelRunner,
    plan: FusionPlan,
    policy: Policy,
    capacity: int | None = None,
    need_logits: bool = True,
    observer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    prefetch_depth: int = 1,
    allocate: Callable[[int], KVBuffer] | None = None,
    graphs: PrefillGraphs | None = None,
) -> Generator[int, None, PrefillResult]:
    """Run the plan a layer at a time: between two layers it yields the token-layers computed so
    far (the layers a CUDA graph replays run as one), and returns the result after the last.
    Left unfinished (closed), it waits for its disk reads to end, so nothing writes into its
    buffer afterwards.

    `observer(layer, rotated queries [A,H,D], active positions [A], rotated keys
    [n,Hkv,D])` sees each layer's attention inputs (Cache-Craft records chunk statistics). Spans
    whose cached KV is still on disk (`ChunkKV.reader`) are read a layer at a time on a thread
    while earlier layers compute, `prefetch_depth` layers before layer 0 starts. `allocate(rows)`
    makes the KV buffer (a KVPool's `take`; default: a new one). `graphs`, where given, replays
    the layers after the policy's last choice of rows from a CUDA graph when one serves them."""
    clock = StageClock(runner.device)
    run = _FusedRun.start(runner, plan, policy, capacity, observer, allocate)
    clock.mark("prefill_setup_s")
    reused = run.rotate_cached()
    clock.mark("prefill_rotate_s")
    # the request's selection (a question probe's model work included, before layer 0)
    selection = run.selection = policy.select(PrefillView(runner, plan, reused))
    token_layers = selection.token_layers
    clock.mark("prefill_probe_s")
    active_mask = selection.initial | ~run.has_cache
    # tokens active from layer 0 that stay active never read their cached rows: skip them
    skip = active_mask if selection.fixed else None
    prefetcher = LayerPrefetcher(plan, run.kv.keys_pre, run.kv.values, prefetch_depth, skip).start()
    # chosen on the host (the masks live there): reading device indices back would wait for the
    # cached keys' rotation queued above
    active_host = active_mask.nonzero().squeeze(1)
    device = runner.device
    must_keep = (~run.has_cache)[active_host]
    active = to_device(active_host, device)
    rows = ActiveRows.start(active, to_device(must_keep, device), runner.embed(run.ids[active]), run.rope,
                            int(must_keep.sum()))
    clock.mark("prefill_setup_s")
    # from this layer on the rows no longer change: a graph may run the rest
    graph_from = selection.refines_until(runner.num_layers) + 1 if run.graphable(graphs) else runner.num_layers
    replayed = None
    finished = False
    try:
        for layer in range(runner.num_layers):
            if layer:  # a pause point between two layers: the token-layers so far
                yield token_layers
                clock.resume()
            prefetcher.wait(layer)
            if layer == graph_from and graphs is not None:
                replayed = graphs.run((run.kv.keys_pre, run.kv.keys, run.kv.values), run.n, layer, rows.index,
                                      rows.hidden)
                if replayed is not None:
                    token_layers += int(rows.index.shape[0]) * (runner.num_layers - layer)
                    clock.mark("prefill_sparse_layers_s")
                    break
            # a layer that starts with most rows active (layer 0 and the check layer of CacheBlend and
            # its kin) is the fixed cost of a selective recompute: timed apart from the sparse ones
            dense = 2 * rows.index.shape[0] > run.n
            token_layers += run.layer(layer, rows)
            clock.mark("prefill_dense_layers_s" if dense else "prefill_sparse_layers_s")
        result = run.finish(rows, need_logits, token_layers, prefetcher, replayed)
        finished = True
    finally:
        if not finished:
            prefetcher.abandon()
    clock.mark("prefill_logits_s")
    result.stage_s = clock.stages
    result.decisions = selection.decided
    return result


@dataclass
class _FusedRun:
    """What every layer of one fused prefill shares: the buffer, the RoPE tables, which rows hold
    cached KV of fused chunks and which of those `tempT` scales."""

    runner: ModelRunner
    plan: FusionPlan
    policy: Policy
    kv: KVBuffer
    ids: torch.Tensor
    positions: torch.Tensor
    rope: RopeTables  # [n, head_dim] per RoPE table, fp32
    has_cache: torch.Tensor  # [n] bool, host
    loaded: int
    load_s: float
    fused: torch.Tensor  # [n] bool, host
    tempered: torch.Tensor  # [n] bool, host
    key_scale: float | None  # 1/T for `tempT`'s tempered rows, None when nothing is scaled
    lazy: bool  # some cached KV still on disk: keys are rotated layer by layer as they arrive
    observer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None
    selection: Selection | None = None  # the policy's, made once the cached KV is in place

    @classmethod
    def start(cls, runner: ModelRunner, plan: FusionPlan, policy: Policy, capacity: int | None,
              observer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None,
              allocate: Callable[[int], KVBuffer] | None = None) -> _FusedRun:
        n = plan.num_tokens
        device = runner.device
        rows = max(capacity or n, n)
        kv = allocate(rows) if allocate is not None else KVBuffer.allocate(runner, rows)
        positions = torch.arange(n, device=device)
        rope = runner.rope_tables(positions)
        has_cache, loaded, load_s = _load_cached(kv, plan)
        fused, tempered = _fused_rows(plan, policy)
        lazy = any(s.cached is not None and s.cached.reader is not None and s.mode != "fresh" for s in plan.spans)
        # `tempT`: the fused chunks' cached keys are scaled by 1/T once rotated, which divides every
        # query's logits on them by T (RoPE is linear); rows recomputed on a layer are overwritten there
        key_scale = 1.0 / policy.temperature if policy.temperature != 1.0 and bool(tempered.any()) else None
        ids = plan_token_ids(plan, device)
        return cls(runner, plan, policy, kv, ids, positions, rope, has_cache, loaded, load_s, fused, tempered,
                   key_scale, lazy, observer)

    @property
    def n(self) -> int:
        return self.plan.num_tokens

    def rotate_cached(self) -> ReusedKV | None:
        """Every layer's cached keys rotated to their new positions in one pass (per layer only the
        recomputed rows are rotated again), unless they arrive layer by layer from disk. A question
        probe reads them from the buffer rather than copying and rotating them once more."""
        if not bool(self.has_cache.any()) or self.lazy:
            return None
        kv, n, runner = self.kv, self.n, self.runner
        if len(runner.inv_freqs) == 1:
            # every layer in one launch (Triton on a GPU: cos/sin made in registers, one read and one
            # write of the keys; the tables on a CPU)
            dispatch.rotate_keys(kv.keys_pre[:, :n], self.positions, runner.inv_freq, out=kv.keys[:, :n],
                                 tables=self.rope.at(0))
        else:  # layers of several RoPE tables (local and global): each by its own
            for layer in range(runner.num_layers):
                dispatch.rotate_keys(kv.keys_pre[layer, :n], self.positions, runner.inv_freq_at(layer),
                                     out=kv.keys[layer, :n], tables=self.rope.at(layer))
        for span in self.plan.spans if self.key_scale is not None else ():
            if span.mode == "fuse" and is_tempered(span.cached, self.policy):
                kv.keys[:, span.start : span.end].mul_(self.key_scale)
        return ReusedKV(kv.keys[:, :n], kv.values[:, :n])

    def rotate_layer(self, layer: int, active: torch.Tensor) -> None:
        """One layer's keys as they arrive from disk."""
        n = self.n
        dispatch.rotate_keys(self.kv.keys_pre[layer, :n], self.positions, self.runner.inv_freq_at(layer),
                             out=self.kv.keys[layer, :n], tables=self.rope.at(layer))
        temper_stale_rows(self.kv.keys[layer, :n], self.tempered, active, self.key_scale)

    def graphable(self, graphs: PrefillGraphs | None) -> bool:
        """Whether this prefill's later layers may replay from `graphs`: its KV is all in place
        (none arrives from disk layer by layer) and no observer reads each layer."""
        return graphs is not None and not self.lazy and self.observer is None

    def rope_at(self, layer: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(x, prompt rows) -> x rotated to those rows' positions by this layer's RoPE."""
        cos, sin = self.rope.at(layer)

        def rotate(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            return dispatch.apply_rope(x, cos[idx], sin[idx])
        return rotate

    def layer(self, layer: int, rows: ActiveRows) -> int:
        """One layer over the active rows (which the policy may shrink first); how many it computed."""
        runner, kv, n = self.runner, self.kv, self.n
        if rows.index.numel() == 0:  # every token reused exactly (a prefix-only run): the cached KV stands
            if self.lazy:
                self.rotate_layer(layer, rows.index)
            return 0
        qkv = runner.qkv(layer, rows.hidden)
        refine = self.selection.refine if self.selection is not None else None
        keep = None if refine is None else refine(
            LayerView(layer, rows.index, rows.must_keep, qkv.k, qkv.v, kv.keys_pre[layer, :n], kv.values[layer, :n],
                      runner.num_layers, qkv.q, self.rope_at(layer), rows.must_keep_count)
        )
        if keep is not None:
            kept = kept_indices(keep, runner.device)
            if kept.numel() < rows.index.numel():
                rows.shrink(kept)
                qkv = qkv.take(kept)
        active = rows.index
        dense = active.shape[0] == n
        if not self.lazy and kv.same_layout and dispatch.resolve_backend(runner.device) == "triton":
            # q rotated, and k (as computed and rotated) and v into the buffer, in one launch
            c = runner.config
            q = dispatch.rope_and_store(qkv.joint, c.num_heads, c.num_kv_heads, active, runner.inv_freq_at(layer),
                                        kv.keys_pre[layer], kv.keys[layer], kv.values[layer])
        else:
            q = self.store_rows(layer, qkv, rows, dense)
        if self.observer is not None:
            self.observer(layer, q, active, kv.keys[layer, :n])
        # positions are 0..n-1 in order, so a row's index is its position (key_pos None says so)
        attn = dispatch.selective_attention(q, kv.keys[layer, :n], kv.values[layer, :n], active, None,
                                            runner.window(layer), dense)
        rows.hidden = runner.mlp(layer, runner.attn_out(layer, rows.hidden, attn.reshape(attn.shape[0], -1)))
        return int(active.shape[0])

    def store_rows(self, layer: int, qkv: QKV, rows: ActiveRows, dense: bool) -> torch.Tensor:
        """The active rows' k (as computed, and rotated) and v into the buffer, op by op; returns
        their q rotated."""
        kv, active, n = self.kv, rows.index, self.n
        q, k_rot = qkv.rotated(*rows.rope.at(layer), active, self.runner.inv_freq_at(layer))
        dispatch.scatter_rows(kv.keys_pre[layer], active, qkv.k)
        dispatch.scatter_rows(kv.values[layer], active, qkv.v)
        if self.lazy:
            self.rotate_layer(layer, active)
        elif dense:
            kv.keys[layer, :n] = k_rot
        else:
            dispatch.scatter_rows(kv.keys[layer], active, k_rot)
        return q

    def finish(self, rows: ActiveRows, need_logits: bool, token_layers: int,
               prefetcher: LayerPrefetcher, replayed: torch.Tensor | None = None) -> PrefillResult:
        """The result, with the last row's logits from `replayed` where a graph ran the last layers."""
        n = self.n
        self.kv.length = n
        if not need_logits:
            logits = None
        elif replayed is not None:
            logits = replayed
        else:
            logits = self.runner.logits(rows.hidden[-1:])[0]
        active_host = rows.index.cpu()  # the one read-back of the prefill, after every layer is queued
        if need_logits and (active_host.numel() == 0 or int(active_host[-1]) != n - 1):
            raise AssertionError("the last prompt token must stay active to produce logits")
        recomputed = int(self.fused[active_host].sum())
        prefetched = prefetcher.finish()
        return PrefillResult(logits, self.kv, token_layers, recomputed, int(self.fused.sum()), self.load_s,
                             self.loaded, prefetcher.times if prefetcher else None, prefetched)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: on a GPU a copy from pageable memory
    waits for every kernel queued before it, so it goes through pinned memory, asynchronously
    (torch's pinned-memory cache keeps the block until the copy is done)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def plan_token_ids(plan: FusionPlan, device: torch.device) -> torch.Tensor:
    """Every token id of the plan as int64 on `device`. A cached span's ids are its entry's, already
    there when the entry is; the rest (question, template, misses) cross once, together: converting
    a long prompt's Python ints one by one would hold up a GPU request's host before its first
    layer."""
    fresh = array("q")
    pieces: list[torch.Tensor | tuple[int, int]] = []
    for span in plan.spans:
        ids = None if span.cached is None or span.cached.reader is not None else span.cached.token_ids
        if ids is not None and ids.device == device and ids.dtype == torch.int64 and ids.shape[0] == len(span):
            pieces.append(ids)
        else:
            pieces.append((len(fresh), len(span)))
            fresh.extend(span.token_ids)
    moved = to_device(torch.frombuffer(fresh, dtype=torch.int64), device) if fresh else None
    parts = [p if isinstance(p, torch.Tensor) else moved[p[0] : p[0] + p[1]]  # type: ignore[index]
             for p in pieces]
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _mask(n: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """[n] bool on the host, true on the rows of these (start, end) spans: made in a bytearray, where
    a slice fill per span in torch would be one dispatched op per span."""
    flags = bytearray(n)
    for start, end in spans:
        flags[start:end] = b"\x01" * (end - start)
    return torch.frombuffer(flags, dtype=torch.bool) if n else torch.zeros(0, dtype=torch.bool)


def kept_indices(keep: torch.Tensor | KeptRows, device: torch.device) -> torch.Tensor:
    """The rows a `refine` keeps, ascending, on the device. With the count known on the host
    (KeptRows) no sync; a bare mask reads its count back once (the next layer's row count): the
    rows are then taken by index, where a boolean mask would read it back once per tensor taken."""
    if isinstance(keep, KeptRows):
        try:
            return torch.nonzero_static(keep.mask.to(device), size=keep.count).squeeze(1)
        except NotImplementedError:  # a torch without it for this device: the read-back below
            keep = keep.mask
    return keep.to(device).nonzero().squeeze(1)


def _load_cached(kv: KVBuffer, plan: FusionPlan) -> tuple[torch.Tensor, int, float]:
    """Copy the RAM-tier KV of the plan's cached spans into the buffer (disk-tier spans arrive a
    layer at a time later). Returns the rows holding cached KV ([n] bool, on the host), how many
    rows were copied, and the seconds it took."""
    started = time.perf_counter()
    loaded = 0
    cached: list[tuple[int, int]] = []
    for span in plan.spans:
        if span.cached is not None and span.mode != "fresh":
            if span.cached.reader is None:
                kv.keys_pre[:, span.start : span.end] = span.cached.keys
                kv.values[:, span.start : span.end] = span.cached.values
                loaded += len(span)
            cached.append((span.start, span.end))
    return _mask(plan.num_tokens, cached), loaded, time.perf_counter() - started


def _fused_rows(plan: FusionPlan, policy: Policy) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of fused chunks, and those of them `tempT` scales ([n] bool each, on the host)."""
    fused = [(s.start, s.end) for s in plan.spans if s.mode == "fuse"]
    tempered = [(s.start, s.end) for s in plan.spans if s.mode == "fuse" and is_tempered(s.cached, policy)]
    return _mask(plan.num_tokens, fused), _mask(plan.num_tokens, tempered)
