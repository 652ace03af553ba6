"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a deep model is hundreds of small launches, and at small batches their host cost
(Python, torch's dispatcher, Triton's launcher) exceeds their GPU time. Captured once, a step
replays as one launch. A step is capturable because:

- every value its kernels read sits at a fixed device address: the token ids and the batched
  decode table (each sequence's KV buffer addresses, layer stride, new row and first visible row,
  whose new-row column is also the RoPE position), written by one host-to-device copy before
  each replay;
- every launch's grid is fixed: the batch is padded to its bucket, and the key slices per
  sequence are fixed per bucket (each program finds its own slice of its sequence's keys on the
  device, so a slice past a short sequence's end does nothing);
- nothing inside it is read back to the host.

The sequences' KV buffers stay where the prefill put them: the table holds their addresses, so a
buffer that grows (a new allocation) is simply a new address at the next step. A padded row
points at a one-row scratch buffer and its logits are dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine_sidecar.engine_config import BatchingConfig
from engine_sidecar.execution.batched_decode import DecodeKV, decode_layers
from engine_sidecar.execution.graph_capture import capture_step, graphs_unavailable
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.model.runner import ModelRunner
from ragcache_kernels import dispatch

log = logging.getLogger("ragcache.decode_graphs")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKENS_ROW = 6  # the inputs' row after the batched decode table's six
POSITION_ROW = 4  # the table's new-row row: the position each new token is rotated to


@dataclass
class BucketGraph:
    """One bucket's fixed inputs, its captured step and the logits that each replay overwrites."""

    batch: int
    inputs: torch.Tensor  # int64 [7, batch] on the device: the table's six rows, then the token ids
    staging: torch.Tensor  # the same on the host (pinned on a GPU), filled before each replay
    step: object  # the batched decode view over `inputs` (triton_decode.DecodeBatch)
    logits: torch.Tensor | None = None  # [batch, vocab], a replay's output
    graph: torch.cuda.CUDAGraph | None = None  # None: the step runs op by op (a CPU, in tests)
    copied: torch.cuda.Event | None = None  # the last inputs copy: staging is free again after it


def decode_graphs(runner: ModelRunner, batching: BatchingConfig, max_context: int) -> DecodeGraphs | None:
    """The engine's graph decoder when its settings ask for one and this runner can use it."""
    if batching.decode_graphs == "off":
        return None
    why_not = DecodeGraphs.unavailable(runner)
    if why_not is not None:
        if batching.decode_graphs == "on":  # asked for by name: say why it does nothing
            log.warning("--decode-graphs on has no effect here: %s", why_not)
        return None
    return DecodeGraphs(runner, batching.max_batch, max_context)


class DecodeGraphs:
    """Decode steps of up to `max_batch` sequences of at most `max_context` tokens from captured
    graphs. `capture=False` runs the same fixed-address step op by op, which is how the CPU
    tests check it against the eager step; in service it is only built on a GPU."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_context: int, capture: bool | None = None,
                 splits: int | None = None):
        self.runner = runner
        self.max_context = max_context
        self.buckets = tuple(b for b in BUCKETS if b < max_batch) + (min(max_batch, BUCKETS[-1]),)
        self.capture = runner.device.type == "cuda" if capture is None else capture
        self.fixed_splits = splits
        self.scratch = KVBuffer.allocate(runner, 1)
        self.graphs: dict[int, BucketGraph] = {}
        self.failed: str | None = None  # why capture failed; the engine decodes op by op from then on
        self.replays = 0
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @staticmethod
    def unavailable(runner: ModelRunner) -> str | None:
        """Why this runner cannot decode from graphs, or None."""
        return graphs_unavailable(runner, "decode graphs")

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def decode(self, kvs: list[DecodeKV], token_ids: list[int]) -> torch.Tensor | None:
        """Logits [B, vocab] of one decode step (each sequence's token appended to its KV), or None
        when no graph serves this step: the caller then decodes op by op. The logits are a view
        that the next replay overwrites: read them before the next step."""
        buffers = [kv for kv in kvs if isinstance(kv, KVBuffer)]
        if len(buffers) != len(kvs):
            return None  # a sequence in the block pool: its decode is not captured
        size = self.bucket(len(kvs))
        if size is None or self.failed is not None or dispatch.resolve_backend(self.runner.device) != "triton":
            return None
        if any(kv.length + 1 > self.max_context for kv in buffers):
            return None  # past the length the fixed key split was sized for
        for kv in buffers:
            kv.ensure_capacity(kv.length + 1)
        graph = self.graphs.get(size) or self._build(size)
        if graph is None:
            return None
        self._fill(graph, buffers, token_ids)
        self._replay(graph)
        for kv in buffers:
            kv.length += 1
        assert graph.logits is not None
        return graph.logits[: len(kvs)]

    # --- building a bucket's graph ---------------------------------------------------------------
    def _build(self, size: int) -> BucketGraph | None:
        from ragcache_kernels import triton_decode

        c, device = self.runner.config, self.runner.device
        inputs = torch.zeros(TOKENS_ROW + 1, size, dtype=torch.int64, device=device)
        staging = torch.zeros(inputs.shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        step = triton_decode.DecodeBatch(inputs[:TOKENS_ROW], size, c.num_kv_heads, c.head_dim, self.runner.dtype,
                                         device, self.max_context, self._splits(size))
        graph = BucketGraph(size, inputs, staging, step)
        self._fill(graph, [], [])  # every row on the scratch buffer: warm-up and capture touch no sequence
        if not self.capture:
            self.graphs[size] = graph
            return graph
        try:
            self._capture(graph)
        except Exception as exc:  # noqa: BLE001 - a driver or kernel refusing capture: decode op by op
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed for %d sequences; decoding op by op from now on: %s",
                        size, self.failed)
            return None
        self.graphs[size] = graph
        return graph

    def _splits(self, size: int) -> int:
        if self.fixed_splits is not None:
            return self.fixed_splits
        from ragcache_kernels.triton_attention import key_splits, multiprocessors
        from ragcache_kernels.triton_decode import default_block_n

        c = self.runner.config
        # the decode attention kernel's own key tile sizes the fixed split
        return key_splits(size * c.num_kv_heads, self.max_context, default_block_n(c.head_dim, self.runner.dtype),
                          multiprocessors(self.runner.device))

    def _capture(self, graph: BucketGraph) -> None:
        graph.graph, graph.logits = capture_step(self.runner.device, self._pool, lambda: self._step(graph))

    def _step(self, graph: BucketGraph) -> torch.Tensor:
        return decode_layers(self.runner, graph.inputs[TOKENS_ROW], graph.inputs[POSITION_ROW],
                             graph.step.write_and_attend)  # type: ignore[attr-defined]

    # --- each step ---------------------------------------------------------------------------------
    def _fill(self, graph: BucketGraph, kvs: list[KVBuffer], token_ids: list[int]) -> None:
        from ragcache_kernels.triton_decode import table_columns

        rows: list[tuple[int, ...]] = []
        if kvs:
            columns, _ = table_columns([kv.keys_pre for kv in kvs], [kv.keys for kv in kvs],
                                       [kv.values for kv in kvs], [kv.length for kv in kvs],
                                       self.runner.window(0))
            rows = [(*col, token) for col, token in zip(columns, token_ids, strict=True)]
        pad = (self.scratch.keys_pre.data_ptr(), self.scratch.keys.data_ptr(), self.scratch.values.data_ptr(),
               self.scratch.keys.stride(0), 0, 0, 0)
        rows += [pad] * (graph.batch - len(rows))
        if graph.copied is not None:
            graph.copied.synchronize()  # the previous step's copy still reads the staging buffer
        graph.staging.copy_(torch.tensor(rows, dtype=torch.int64).T)
        graph.inputs.copy_(graph.staging, non_blocking=True)
        if graph.inputs.device.type == "cuda":
            graph.copied = torch.cuda.Event()
            graph.copied.record()

    def _replay(self, graph: BucketGraph) -> None:
        self.replays += 1
        if graph.graph is not None:
            graph.graph.replay()
        else:
            graph.logits = self._step(graph)
