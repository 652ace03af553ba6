"""A paged KV pool: every sequence's decode KV in fixed-size blocks of shared device tensors.

A `KVBuffer` reserves prompt + max_tokens rows per request up front, so admission is bounded by
reservations that mostly stay empty (a request that stops early never uses its tail). Here the
memory is one pair of tensors, keys (after RoPE) and values, [L, num_blocks, block_size, Hkv, D],
cut into blocks of `block_size` rows; a sequence holds a `BlockTable` (its blocks in row order and
its length), takes a block only when its last one fills, and gives them all back when it ends.
Waste is at most one partial block per sequence.

Only what decode reads lives here: rotated keys and values. Pre-RoPE keys (what the chunk store
keeps) stay with the prefill's buffer. `table_tensor` and `lengths` are the inputs of the paged
decode kernel (`ragcache_kernels.dispatch.paged_decode_attention`), which reads a layer's blocks
(`layer(l)`) through the tables in place; `gather` copies a sequence's rows out contiguously, for
references and for committing KV elsewhere.

The pool is plain bookkeeping over a free list, not thread-safe: the one thread that schedules
sequences owns it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch


class KVGeometry(Protocol):
    """What the pool needs of a model's config (`ModelConfig` has these)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs; nothing was taken."""


class BlockTableError(ValueError):
    """A table the pool did not hand out, or has taken back already (a double free)."""


@dataclass
class BlockTable:
    """One sequence's rows: row i is at blocks[i // block_size], offset i % block_size."""

    table_id: int  # the pool's handle: a freed table's id is never reused, so a stale table is caught
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class BlockPool:
    def __init__(self, config: KVGeometry, dtype: torch.dtype, device: torch.device | str, *,
                 block_size: int = 16, num_blocks: int | None = None, max_bytes: int | None = None):
        """Blocks of `block_size` rows for every layer: `num_blocks` of them, or as many as fit in
        `max_bytes` (keys and values together); exactly one of the two."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if (num_blocks is None) == (max_bytes is None):
            raise ValueError("give the pool's size as exactly one of num_blocks and max_bytes")
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        self._row_shape = (config.num_layers, config.num_kv_heads, config.head_dim)
        if num_blocks is None:
            assert max_bytes is not None
            num_blocks = max_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"a pool needs at least one block of {self.bytes_per_block} bytes")
        self.num_blocks = num_blocks
        layers, kv_heads, head_dim = self._row_shape
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=self.device)
        self.values = torch.empty(shape, dtype=dtype, device=self.device)
        # a stack: popped from the end, so block 0 is handed out first and a freed block next
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owner: list[int | None] = [None] * num_blocks  # table_id holding each block
        self._live: set[int] = set()
        self._ids = itertools.count()

    @property
    def bytes_per_block(self) -> int:
        layers, kv_heads, head_dim = self._row_shape
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * layers * self.block_size * kv_heads * head_dim * element

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` rows."""
        return -(-tokens // self.block_size)

    def can_fit(self, tokens: int) -> bool:
        """Whether a new sequence of `tokens` rows can be allocated now."""
        return self.blocks_for(tokens) <= self.free_blocks

    def blocks_to_append(self, table: BlockTable, n: int) -> int:
        """Blocks `append_slots(table, n)` would take: only those its rows spill into."""
        return self.blocks_for(table.length + n) - len(table.blocks)

    def allocate(self, tokens: int) -> BlockTable:
        """A new sequence's table with room for `tokens` rows (length `tokens`)."""
        if tokens < 0:
            raise ValueError(f"cannot allocate {tokens} rows")
        if not self.can_fit(tokens):
            raise OutOfBlocksError(f"{self.blocks_for(tokens)} blocks needed, {self.free_blocks} free "
                                   f"of {self.num_blocks}")
        table = BlockTable(next(self._ids))
        self._live.add(table.table_id)
        self.append_slots(table, tokens)
        return table

    def append_slots(self, table: BlockTable, n: int) -> int:
        """Grow `table` by `n` rows, taking blocks only as its last one fills; the first new row's
        index. Raises OutOfBlocksError, with the table and pool unchanged, if they do not fit."""
        self._check_live(table)
        if n < 0:
            raise ValueError(f"cannot append {n} rows")
        need = self.blocks_to_append(table, n)
        if need > self.free_blocks:
            raise OutOfBlocksError(f"{need} blocks needed, {self.free_blocks} free of {self.num_blocks}")
        for _ in range(need):
            block = self._free.pop()
            self._owner[block] = table.table_id
            table.blocks.append(block)
        start, table.length = table.length, table.length + n
        return start

    def free(self, table: BlockTable) -> None:
        """Give the table's blocks back and empty it. Freeing it again raises BlockTableError: a
        stale table's blocks may already belong to another sequence."""
        self._check_live(table)
        if any(self._owner[block] != table.table_id for block in table.blocks):
            raise BlockTableError(f"table {table.table_id} lists blocks it does not own")
        for block in reversed(table.blocks):
            self._owner[block] = None
            self._free.append(block)
        self._live.discard(table.table_id)
        table.blocks, table.length = [], 0

    def _check_live(self, table: BlockTable) -> None:
        if table.table_id not in self._live:
            raise BlockTableError(f"table {table.table_id} is not held in this pool (freed already?)")

    def slots(self, table: BlockTable, start: int, n: int) -> torch.Tensor:
        """Flat indices [n] int64 (block * block_size + offset) of rows [start, start + n) in the
        pool viewed as [L, num_blocks * block_size, Hkv, D]."""
        self._check_live(table)
        if start < 0 or n < 0 or start + n > table.length:
            raise ValueError(f"rows [{start}, {start + n}) outside a table of {table.length}")
        rows = torch.arange(start, start + n, device=self.device)
        blocks = torch.tensor(table.blocks, dtype=torch.int64, device=self.device)
        return blocks[rows // self.block_size] * self.block_size + rows % self.block_size

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        layers, kv_heads, head_dim = self._row_shape
        shape = (layers, self.num_blocks * self.block_size, kv_heads, head_dim)
        return self.keys.view(shape), self.values.view(shape)

    def write(self, table: BlockTable, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows [start, start + n) of every layer from keys/values [L, n, Hkv, D] (one index copy
        per tensor, whatever the rows' blocks)."""
        expected = (self._row_shape[0], keys.shape[1], *self._row_shape[1:])
        if tuple(keys.shape) != expected or values.shape != keys.shape:
            raise ValueError(f"rows must be [L, n, Hkv, D] = {expected}, got {tuple(keys.shape)}, "
                             f"{tuple(values.shape)}")
        if keys.dtype != self.dtype or values.dtype != self.dtype:
            raise ValueError(f"rows are {keys.dtype}/{values.dtype}, the pool {self.dtype}")
        index = self.slots(table, start, keys.shape[1])
        flat_keys, flat_values = self._flat()
        flat_keys.index_copy_(1, index, keys.to(self.device))
        flat_values.index_copy_(1, index, values.to(self.device))

    def gather(self, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of the sequence, each a new contiguous [L, length, Hkv, D] tensor."""
        index = self.slots(table, 0, table.length)
        flat_keys, flat_values = self._flat()
        return flat_keys.index_select(1, index), flat_values.index_select(1, index)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (key blocks, value blocks), [num_blocks, block_size, Hkv, D] views."""
        return self.keys[layer], self.values[layer]

    def table_tensor(self, tables: list[BlockTable], width: int | None = None) -> torch.Tensor:
        """int32 [B, width] block ids on the pool's device (width: the longest table, or more,
        so that a captured launch keeps its shape), padded with block 0: the kernel masks rows
        past a sequence's length, so padding is never read, and were it read it stays in bounds."""
        longest = max((len(t.blocks) for t in tables), default=0)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"width {width} is narrower than a table of {longest} blocks")
        rows = [t.blocks + [0] * (width - len(t.blocks)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width).to(self.device)

    def lengths(self, tables: list[BlockTable]) -> torch.Tensor:
        """int32 [B] rows per sequence on the pool's device."""
        return torch.tensor([t.length for t in tables], dtype=torch.int32).to(self.device)
