"""A fused prefill's sparse layers replayed from CUDA graphs, one graph per row bucket and first
layer.

Once a policy has made its last choice of rows (before layer 0 for `reuse`, `epic` and `prophet`;
after the check layer for CacheBlend), every later layer computes the same rows: the question's
and the few kept for recompute. On a GPU those layers are a few hundred small launches whose host
cost (Python, torch's dispatcher, Triton's launcher) is several times their device time. Captured
once, they replay as one launch. They are capturable because:

- every value their kernels read sits at a fixed device address: the rows' hidden states and
  positions, and a small table (the request's KV buffer addresses, layer stride, key count, row
  count and last row), rewritten by one host-to-device copy and two device copies before each
  replay (ragcache_kernels.triton_prefill_table);
- every launch's grid is fixed: the rows are padded to the bucket (padded rows repeat the last
  position and store nothing) and the keys are split a fixed number of ways, each slice's length
  following the request's key count on the device;
- nothing inside reads a value back to the host; the graph ends with the last row's logits.

A graph replays only where that is faster. Its rows are padded to the bucket, so layers whose
device time outweighs their launches (many rows of a large model: CacheBlend's 15% of an 8B
prompt) run faster op by op. Each graph is timed once when captured: the host's time to launch
its layers op by op and the device's time to replay them. Op by op, those launches also overlap
the device's work on the layers before the graph's first (CacheBlend's dense layers over every
row of the prompt, estimated from the largest graph's time per row and layer). A prefill replays
when the replay's time is under the launches' time left after that overlap; otherwise the device
is the bound either way and the unpadded rows op by op cost less.

The request's KV buffer stays where the prefill put it: the table holds its addresses.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from engine_sidecar.execution.graph_capture import capture_step, graphs_unavailable
from engine_sidecar.execution.policies.cacheblend import CacheBlendPolicy
from engine_sidecar.model.runner import ModelRunner
from ragcache_kernels import dispatch

log = logging.getLogger("ragcache.prefill_graphs")

# Row buckets: a request's kept rows are padded up to the next one. Above the last, a layer's
# device time outweighs its launches and the layers run op by op.
BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
# a request's KV buffer: keys before RoPE, rotated keys, values ([layers, capacity, kv_heads, head_dim])
KVTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class SparseGraph:
    """One bucket's fixed inputs from one first layer on, its captured layers and their logits."""

    bucket: int
    first_layer: int
    inputs: torch.Tensor  # int64 [TABLE_SIZE + bucket] on the device: the table, then the rows' positions
    staging: torch.Tensor  # the table on the host (pinned on a GPU), filled before each replay
    hidden: torch.Tensor  # [bucket, hidden] the rows' hidden states entering `first_layer`
    view: object  # triton_prefill_table.PrefillTable over `inputs`
    logits: torch.Tensor | None = None  # [vocab] fp32, a replay's output
    graph: torch.cuda.CUDAGraph | None = None  # None: the layers run op by op (a CPU, in tests)
    copied: torch.cuda.Event | None = None  # the last table copy: staging is free again after it
    launch_s: float | None = None  # the host's time to launch these layers op by op, timed at capture
    replay_s: float | None = None  # the device's time to replay them, timed at capture

    def row_layer_s(self, num_layers: int) -> float | None:
        """The device's seconds per row and layer in this graph's replay (timed at capture)."""
        return None if self.replay_s is None else self.replay_s / (self.bucket * (num_layers - self.first_layer))

    def replays_faster(self, num_keys: int, num_layers: int, row_layer_s: float | None = None) -> bool:
        """Whether replaying these layers of a prefill over `num_keys` prompt rows beats launching
        them op by op (untimed, as on a CPU: replay). Op by op, the launches overlap the device's
        work on the layers before, over every row, at `row_layer_s` seconds per row and layer (by
        default this graph's own)."""
        if self.launch_s is None or self.replay_s is None:
            return True
        per_row = self.row_layer_s(num_layers) if row_layer_s is None else row_layer_s
        return self.replay_s < self.launch_s - self.first_layer * num_keys * per_row


def load_first_layers(num_layers: int) -> tuple[int, ...]:
    """The first layers whose graphs are captured at load: layer 0 (`reuse`, `epic`, `prophet`)
    and the layer after CacheBlend's check (the default policy)."""
    return tuple(sorted({0, CacheBlendPolicy().final_refine_layer(num_layers) + 1}))


def prefill_graphs(runner: ModelRunner, mode: str, max_context: int) -> PrefillGraphs | None:
    """The engine's sparse-layer graphs when `mode` asks for them and this runner can use them."""
    if mode == "off":
        return None
    why_not = PrefillGraphs.unavailable(runner)
    if why_not is not None:
        if mode == "on":  # asked for by name: say why it does nothing
            log.warning("--prefill-graphs on has no effect here: %s", why_not)
        return None
    return PrefillGraphs(runner, max_context)


class PrefillGraphs:
    """Sparse layers of prompts of at most `max_context` tokens from captured graphs.
    `capture=False` runs the same fixed-address layers op by op, which is how the CPU tests check
    them against the executor's own layers; in service it is only built on a GPU."""

    def __init__(self, runner: ModelRunner, max_context: int, capture: bool | None = None,
                 splits: int | None = None, buckets: tuple[int, ...] = BUCKETS):
        self.runner = runner
        self.max_context = max_context
        self.buckets = buckets
        self.capture = runner.device.type == "cuda" if capture is None else capture
        self.fixed_splits = splits
        self.graphs: dict[tuple[int, int], SparseGraph] = {}
        self.failed: str | None = None  # why capture failed; the layers run op by op from then on
        self.replays = 0
        self.launched = 0  # prefills a graph served but ran op by op, where that is faster
        self._lock = threading.Lock()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @staticmethod
    def unavailable(runner: ModelRunner) -> str | None:
        """Why this runner cannot replay prefill layers from graphs, or None."""
        return graphs_unavailable(runner, "prefill graphs")

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def serves(self, kv: KVTensors, num_keys: int, rows: int) -> bool:
        """Whether a graph can run the remaining layers of this prefill: its rows fit a bucket and
        are fewer than its keys (all rows active is full prefill, dense attention's job), and the
        table can describe its buffer."""
        if self.failed is not None or not 0 < rows < num_keys <= self.max_context or self.bucket(rows) is None:
            return False
        if dispatch.resolve_backend(self.runner.device) != "triton":
            return False
        from ragcache_kernels.triton_prefill_table import addressable

        return addressable(*kv)

    @torch.inference_mode()
    def run(self, kv: KVTensors, num_keys: int, first_layer: int, rows: torch.Tensor,
            hidden: torch.Tensor) -> torch.Tensor | None:
        """Layers `first_layer`.. of a prefill over the first `num_keys` rows of a KV buffer `kv`
        (its keys before RoPE, rotated keys and values), for the prompt rows `rows` [A] (device,
        ascending, the last one num_keys - 1) entering with `hidden` [A, hidden]: their k and v
        stored in `kv`, and the last row's logits [vocab] (fp32) returned. None when no graph
        serves it: the caller runs the layers op by op."""
        count = int(rows.shape[0])
        size = self.bucket(count)
        if size is None or not self.serves(kv, num_keys, count):
            return None
        with self._lock:
            graph = self.graphs.get((size, first_layer)) or self._build(size, first_layer)
            if graph is None:
                return None
            if not graph.replays_faster(num_keys, self.runner.num_layers, self._row_layer_s(first_layer)):
                self.launched += 1
                return None
            self._fill(graph, kv, num_keys, rows, hidden)
            self._replay(graph)
            assert graph.logits is not None
            return graph.logits.clone()  # the next replay overwrites the graph's own

    def capture_all(self, first_layers: tuple[int, ...]) -> tuple[int, float]:
        """Every bucket's graph from each of these first layers, now (at load: the Triton kernels
        compile and the graphs are captured before the first request, not on it). Returns how many
        graphs there are and the seconds it took."""
        started = time.perf_counter()
        with self._lock, torch.inference_mode():
            for first_layer in first_layers:
                for size in self.buckets:
                    if self.failed is None and (size, first_layer) not in self.graphs:
                        self._build(size, first_layer)
        return len(self.graphs), time.perf_counter() - started

    # --- building a bucket's graph ---------------------------------------------------------------
    def _build(self, size: int, first_layer: int) -> SparseGraph | None:
        from ragcache_kernels import triton_prefill_table as table

        c, device = self.runner.config, self.runner.device
        inputs = torch.zeros(table.TABLE_SIZE + size, dtype=torch.int64, device=device)
        staging = torch.zeros(table.TABLE_SIZE, dtype=torch.int64, pin_memory=device.type == "cuda")
        view = table.PrefillTable(inputs[: table.TABLE_SIZE], inputs[table.TABLE_SIZE :], c.num_heads,
                                  c.num_kv_heads, c.head_dim, self._splits(size), self.runner.window(0))
        hidden = torch.zeros(size, c.hidden_size, dtype=self.runner.dtype, device=device)
        graph = SparseGraph(size, first_layer, inputs, staging, hidden, view)
        # warm-up and capture store into a one-row buffer of their own, never a request's
        scratch = tuple(torch.zeros(c.num_layers, 1, c.num_kv_heads, c.head_dim, dtype=self.runner.dtype,
                                    device=device) for _ in range(3))
        self._fill(graph, scratch, 1, torch.zeros(1, dtype=torch.int64, device=device), hidden[:1])
        if not self.capture:
            self.graphs[(size, first_layer)] = graph
            return graph
        try:
            self._capture(graph)
        except Exception as exc:  # noqa: BLE001 - a driver or kernel refusing capture: run op by op
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed for %d prefill rows; running sparse layers op by op from now "
                        "on: %s", size, self.failed)
            return None
        self.graphs[(size, first_layer)] = graph
        return graph

    def _splits(self, size: int) -> int:
        if self.fixed_splits is not None:
            return self.fixed_splits
        import triton

        from ragcache_kernels.triton_attention import default_blocks, key_splits, multiprocessors

        c = self.runner.config
        block_m, block_n = default_blocks(c.head_dim, self.runner.dtype)
        # sized for the longest prompt: a shorter one's slices are shorter, none is left idle
        return key_splits(triton.cdiv(size, block_m) * c.num_heads, self.max_context, block_n,
                          multiprocessors(self.runner.device))

    def summary(self, num_keys: int) -> list[dict[str, object]]:
        """Each graph: its rows and first layer, its timings at capture (ms) and whether it replays
        a prefill over `num_keys` prompt rows."""
        return [{"rows": size, "first_layer": first,
                 "launch_ms": None if g.launch_s is None else round(g.launch_s * 1e3, 3),
                 "replay_ms": None if g.replay_s is None else round(g.replay_s * 1e3, 3),
                 "replays": g.replays_faster(num_keys, self.runner.num_layers, self._row_layer_s(first))}
                for (size, first), g in sorted(self.graphs.items())]

    def _row_layer_s(self, first_layer: int) -> float | None:
        """The device's time per row and layer from the largest timed graph of this first layer: a
        small bucket's replay is mostly reading the weights, which the dense layers before it read
        once for every row of the prompt."""
        timed = [g for (_, first), g in self.graphs.items() if first == first_layer and g.replay_s is not None]
        return max(timed, key=lambda g: g.bucket).row_layer_s(self.runner.num_layers) if timed else None

    def _capture(self, graph: SparseGraph) -> None:
        graph.graph, graph.logits = capture_step(self.runner.device, self._pool, lambda: self._layers(graph))
        graph.launch_s, graph.replay_s = self._time(graph)

    def _time(self, graph: SparseGraph) -> tuple[float, float]:
        """The host's seconds to launch the graph's layers op by op (the device idle, so nothing
        waits; the shorter of two tries, the first may meet a one-time cost) and the device's
        seconds to replay them."""
        assert graph.graph is not None
        device = self.runner.device
        launch_s = float("inf")
        for _ in range(2):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            self._layers(graph)
            launch_s = min(launch_s, time.perf_counter() - started)
        torch.cuda.synchronize(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.graph.replay()
        end.record()
        end.synchronize()
        return launch_s, begin.elapsed_time(end) / 1e3

    def _layers(self, graph: SparseGraph) -> torch.Tensor:
        from ragcache_kernels.triton_prefill_table import LAST_ROW

        runner, view = self.runner, graph.view
        hidden = graph.hidden
        for layer in range(graph.first_layer, runner.num_layers):
            qkv = runner.qkv(layer, hidden)
            q = view.store(layer, qkv.joint, runner.inv_freq_at(layer))  # type: ignore[attr-defined]
            attn = view.attend(layer, q)  # type: ignore[attr-defined]
            hidden = runner.mlp(layer, runner.attn_out(layer, hidden, attn.reshape(graph.bucket, -1)))
        last = hidden.index_select(0, graph.inputs[LAST_ROW : LAST_ROW + 1])
        return runner.logits(last)[0]

    # --- each prefill ------------------------------------------------------------------------------
    def _fill(self, graph: SparseGraph, kv: KVTensors, num_keys: int, rows: torch.Tensor,
              hidden: torch.Tensor) -> None:
        from ragcache_kernels import triton_prefill_table as table

        count = int(rows.shape[0])
        values = table.table_values(*kv, num_keys, count)
        if graph.copied is not None:
            graph.copied.synchronize()  # the previous table copy still reads the staging buffer
        graph.staging.copy_(torch.tensor(values, dtype=torch.int64))
        graph.inputs[: table.TABLE_SIZE].copy_(graph.staging, non_blocking=True)
        if graph.inputs.device.type == "cuda":
            graph.copied = torch.cuda.Event()
            graph.copied.record()
        positions = graph.inputs[table.TABLE_SIZE :]
        positions[:count].copy_(rows)
        # padded rows at the last position keep each query block's visible keys tight; they store
        # nothing, and their hidden states (earlier requests' rows) stay finite
        positions[count:].fill_(num_keys - 1)
        graph.hidden[:count].copy_(hidden)

    def _replay(self, graph: SparseGraph) -> None:
        self.replays += 1
        if graph.graph is not None:
            graph.graph.replay()
        else:
            graph.logits = self._layers(graph)
