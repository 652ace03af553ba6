"""One decode step for several running sequences at once, each appending its new token to its own
KV (a buffer of its own, or its blocks of the engine's pool) at its own position."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.execution.paged_kv import PagedKV, PagedStep
from engine_sidecar.model.runner import ModelRunner
from ragcache_kernels import dispatch
from ragcache_kernels.attention import single_query_attention

DecodeKV = KVBuffer | PagedKV  # a running sequence's KV: a buffer of its own, or blocks of the pool


def decode_step(runner: ModelRunner, kv: KVBuffer, token_id: int) -> torch.Tensor:
    """Append one token at position kv.length and return its logits [vocab]."""
    return decode_batch(runner, [kv], [token_id])[0]


@torch.inference_mode()
def decode_batch(runner: ModelRunner, kvs: list[DecodeKV], token_ids: list[int]) -> torch.Tensor:
    """One decode step for several sequences at once: token i is appended to kvs[i] at its own
    position. Projections and MLPs run as one matmul over the batch (on a CPU a [B, hidden]
    GEMM costs about what a [1, hidden] one does: the weights are read once). Sequences whose KV
    is in the block pool (`PagedKV`) write their rows in one index copy per layer and attend
    through their block tables together; for those with a buffer of their own, with the Triton
    kernels, every new row is written in one launch per layer and attended in another, otherwise
    row by row (on a CPU in bf16 the attention is one native call). Returns logits [B, vocab]."""
    paged = [i for i, kv in enumerate(kvs) if isinstance(kv, PagedKV)]
    own = [i for i, kv in enumerate(kvs) if not isinstance(kv, PagedKV)]
    step = PagedStep(runner, [kvs[i] for i in paged]) if paged else None  # type: ignore[misc]
    buffers: list[KVBuffer] = [kvs[i] for i in own]  # type: ignore[misc]
    attend_own = buffer_attention(runner, buffers) if buffers else None
    if step is None:
        attend = attend_own
        positions = [kv.length for kv in buffers]
    elif attend_own is None:
        attend = _paged_only(step)
        positions = step.positions
    else:
        attend = _mixed(step, attend_own, paged, own)
        starts = dict(zip(paged, step.positions, strict=True)) | {i: kvs[i].length for i in own}
        positions = [starts[i] for i in range(len(kvs))]
    assert attend is not None
    device = runner.device
    logits = decode_layers(runner, torch.tensor(token_ids, device=device), torch.tensor(positions, device=device),
                           attend)
    for kv in buffers:
        kv.length += 1
    return logits


def buffer_attention(runner: ModelRunner, kvs: list[KVBuffer]) -> WriteAndAttend:
    """The step's write-and-attend over sequences with buffers of their own, grown by a row."""
    positions = [kv.length for kv in kvs]
    for kv, pos in zip(kvs, positions, strict=True):
        kv.ensure_capacity(pos + 1)
    # one table of key ranges per distinct window (most models: one for every layer)
    tables = {window: dispatch.batched_decode([kv.keys_pre for kv in kvs], [kv.keys for kv in kvs],
                                              [kv.values for kv in kvs], positions, window)
              for window in set(runner.layer_windows)}
    if all(table is not None for table in tables.values()):
        def attend(layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            return tables[runner.window(layer)].write_and_attend(layer, q, k_pre, k_rot, v)  # type: ignore[union-attr]
        return attend

    def attend_rows(layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor,
                    v: torch.Tensor) -> torch.Tensor:
        return attend_each(layer, kvs, positions, runner.window(layer), q, k_pre, k_rot, v)
    return attend_rows


def _paged_only(step: PagedStep) -> WriteAndAttend:
    def attend(layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return step.write_and_attend(layer, q, k_rot, v)
    return attend


def _mixed(step: PagedStep, attend_own: WriteAndAttend, paged: list[int], own: list[int]) -> WriteAndAttend:
    """Both kinds in one batch: each group attends its rows of the batch, put back in batch order."""
    device = step.pool.device
    paged_rows = torch.tensor(paged, device=device)
    own_rows = torch.tensor(own, device=device)

    def attend(layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from_pool = step.write_and_attend(layer, q[paged_rows], k_rot[paged_rows], v[paged_rows])
        from_own = attend_own(layer, q[own_rows], k_pre[own_rows], k_rot[own_rows], v[own_rows])
        out = from_pool.new_empty((q.shape[0], from_pool.shape[1]))
        out[paged_rows] = from_pool
        out[own_rows] = from_own.to(out.dtype)
        return out
    return attend


# (layer, q [B, H, D], pre-RoPE keys, rotated keys, values [B, Hkv, D]) -> attention [B, H * D],
# after writing the new rows into each sequence's KV
WriteAndAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decode_layers(runner: ModelRunner, tokens: torch.Tensor, positions: torch.Tensor,
                  attend: WriteAndAttend) -> torch.Tensor:
    """Every layer of one decode step, from the new tokens [B] at `positions` [B] to logits
    [B, vocab]. It reads no value back to the host, so a CUDA graph can capture it whole."""
    # in the activations' dtype once per step, not per layer and tensor
    rope = runner.rope_tables(positions).to(runner.dtype)
    hidden = runner.embed(tokens)
    for layer in range(runner.num_layers):
        qkv = runner.qkv(layer, hidden)
        q, k_rot = qkv.rotated(*rope.at(layer))
        attn = attend(layer, q, qkv.k, k_rot, qkv.v)
        hidden = runner.mlp(layer, runner.attn_out(layer, hidden, attn))
    return runner.logits(hidden)


def attend_each(layer: int, kvs: list[KVBuffer], positions: list[int], window: int | None, q: torch.Tensor,
                 k_pre: torch.Tensor, k_rot: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Sequence by sequence: write each new row, then attend (every sequence in one native call
    where it applies, bf16 on a CPU; else one torch call each). Returns [B, H * D]."""
    q = q.contiguous()  # the native call reads rows of H * D
    keys, visible_values = [], []
    for i, (kv, pos) in enumerate(zip(kvs, positions, strict=True)):
        kv.keys_pre[layer, pos] = k_pre[i]
        kv.keys[layer, pos] = k_rot[i]
        kv.values[layer, pos] = values[i]
        start = 0 if window is None else max(0, pos + 1 - window)
        keys.append(kv.keys[layer, start : pos + 1])
        visible_values.append(kv.values[layer, start : pos + 1])
    attn = dispatch.decode_attention(q, keys, visible_values)
    if attn is None:
        outputs = [single_query_attention(q[i], keys[i], visible_values[i], None) for i in range(len(kvs))]
        attn = torch.stack(outputs) if len(outputs) > 1 else outputs[0][None]
    return attn
