"""A running sequence's decode KV held in the engine's block pool instead of a buffer of its own.

With `--kv-block-size`, the prefill still computes into a transient `KVBuffer` (keys before and
after RoPE, values: what the commit of chunk KV reads), and as soon as the commit has run, the
prompt's rotated keys and values move into blocks of the pool and the buffer is let go. Decode
then appends one row per step, taking a new block only when the last one fills; a finished
sequence gives its blocks back at once. What decode never reads, the pre-RoPE keys, is not kept:
where a commit after decode needs them (a conversation's history), they are rotated back from
the pool's keys, which is exact up to the rounding of one rotation in the pool's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_sidecar.execution.block_pool import BlockPool, BlockTable
from engine_sidecar.execution.kv_buffer import KVBuffer
from engine_sidecar.model.runner import ModelRunner
from ragcache_kernels import dispatch


@dataclass(eq=False)
class PagedKV:
    pool: BlockPool
    table: BlockTable
    reserved: int  # rows it may reach (prompt + max_tokens + 1), as the scheduler counts them

    @classmethod
    def from_buffer(cls, pool: BlockPool, kv: KVBuffer, reserved: int) -> PagedKV:
        """The buffer's rows [0, kv.length) copied into new blocks of `pool`."""
        table = pool.allocate(kv.length)
        if kv.length:
            pool.write(table, 0, kv.keys[:, : kv.length], kv.values[:, : kv.length])
        return cls(pool, table, max(reserved, kv.length))

    @property
    def length(self) -> int:
        return self.table.length

    @property
    def capacity(self) -> int:
        """Rows it may reach (its blocks hold `held_rows`)."""
        return self.reserved

    @property
    def held_rows(self) -> int:
        return len(self.table.blocks) * self.pool.block_size

    def release(self) -> None:
        self.pool.free(self.table)

    def to_buffer(self, runner: ModelRunner) -> KVBuffer:
        """Its rows as a new contiguous KVBuffer, pre-RoPE keys rotated back from the pool's keys
        (in fp32, each layer by its own RoPE table)."""
        keys, values = self.pool.gather(self.table)
        positions = torch.arange(self.length, device=keys.device)
        tables = runner.rope_tables(positions)
        keys_pre = torch.empty_like(keys)
        for layer in range(keys.shape[0]):
            cos, sin = tables.at(layer)
            keys_pre[layer] = dispatch.apply_rope(keys[layer].float(), cos.float(), -sin.float()).to(keys.dtype)
        return KVBuffer(keys_pre, keys, values, length=self.length)


class PagedStep:
    """One decode step's view of the paged sequences in a batch: each gets one row appended (its
    slot taken before the step, so a step never runs out of blocks part-way), then every layer
    writes the new rows in one index copy and attends through the block tables."""

    def __init__(self, runner: ModelRunner, kvs: list[PagedKV]):
        pool = kvs[0].pool
        self.runner, self.pool = runner, pool
        self.positions = [pool.append_slots(kv.table, 1) for kv in kvs]
        slots = [kv.table.blocks[pos // pool.block_size] * pool.block_size + pos % pool.block_size
                 for kv, pos in zip(kvs, self.positions, strict=True)]
        self.slots = torch.tensor(slots, dtype=torch.int64, device=pool.device)
        self.block_tables = pool.table_tensor([kv.table for kv in kvs])
        self.lengths = pool.lengths([kv.table for kv in kvs])
        c = runner.config
        self.flat_shape = (pool.num_blocks * pool.block_size, c.num_kv_heads, c.head_dim)
        self.scale = c.head_dim**-0.5  # as every decode attention here: a family's own query scale is in q
        self.tables = [kv.table for kv in kvs]
        self._rows: dict[int | None, list[torch.Tensor]] = {}  # each sequence's visible slots, per window

    def write_and_attend(self, layer: int, q: torch.Tensor, k_rot: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """New rows of one layer written, then q [P, H, D] attended over each sequence's rows ->
        [P, H * D]."""
        key_blocks, value_blocks = self.pool.layer(layer)
        flat_keys, flat_values = key_blocks.view(self.flat_shape), value_blocks.view(self.flat_shape)
        flat_keys.index_copy_(0, self.slots, k_rot.to(key_blocks.dtype))
        flat_values.index_copy_(0, self.slots, values.to(value_blocks.dtype))
        window = self.runner.window(layer)
        if q.device.type == "cpu":
            # each sequence's rows gathered in their own dtype for the native CPU kernel the
            # buffers' decode uses: one copy of the rows read, where the torch reference converts
            # them to fp32 and pads every sequence to the longest
            rows = self._visible_rows(window)
            keys = [flat_keys.index_select(0, r) for r in rows]
            visible_values = [flat_values.index_select(0, r) for r in rows]
            out = dispatch.decode_attention(q.contiguous(), keys, visible_values)
            if out is not None:
                return out
        out = dispatch.paged_decode_attention(q, key_blocks, value_blocks, self.block_tables, self.lengths,
                                              self.scale, window)
        return out.reshape(q.shape[0], -1)

    def _visible_rows(self, window: int | None) -> list[torch.Tensor]:
        """Each sequence's slots of the rows its query sees (the last `window` with a sliding
        window), made once per step and window."""
        if window not in self._rows:
            self._rows[window] = [self.pool.slots(t, max(0, t.length - window) if window else 0,
                                                  t.length - (max(0, t.length - window) if window else 0))
                                  for t in self.tables]
        return self._rows[window]
