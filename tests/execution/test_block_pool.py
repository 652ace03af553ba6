"""The paged KV pool's bookkeeping and data movement, on a CPU.

Accounting: blocks are taken only when a sequence's last block fills, an allocation or growth
that does not fit raises and changes nothing, a double free raises without touching the free
list, and freed blocks are handed out again. Data: rows written through tables whose blocks are
scattered over the pool (the free list fragmented by interleaved allocations and frees) read
back exactly, and the padded table tensor feeds the paged attention reference, which agrees with
dense attention over the gathered rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine_sidecar.execution.block_pool import BlockPool, BlockTable, BlockTableError, OutOfBlocksError
from ragcache_kernels import dispatch
from ragcache_kernels.paged_decode import paged_decode_attention_reference


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 3
    num_kv_heads: int = 2
    head_dim: int = 8


def _pool(num_blocks: int = 8, block_size: int = 4, dtype: torch.dtype = torch.float32) -> BlockPool:
    return BlockPool(Geometry(), dtype, "cpu", block_size=block_size, num_blocks=num_blocks)


def _rows(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (3, n, 2, 8)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _state(pool: BlockPool, *tables: BlockTable) -> tuple:
    return pool.free_blocks, [(t.table_id, list(t.blocks), t.length) for t in tables]


def test_size_from_a_byte_budget() -> None:
    pool = _pool()
    assert pool.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 4
    sized = BlockPool(Geometry(), torch.float32, "cpu", block_size=4, max_bytes=5 * pool.bytes_per_block + 7)
    assert sized.num_blocks == sized.free_blocks == 5
    assert sized.keys.shape == sized.values.shape == (3, 5, 4, 2, 8)
    with pytest.raises(ValueError, match="exactly one"):
        BlockPool(Geometry(), torch.float32, "cpu", num_blocks=4, max_bytes=10**6)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(Geometry(), torch.float32, "cpu", max_bytes=pool.bytes_per_block - 1)


def test_blocks_are_taken_only_on_block_boundaries() -> None:
    pool = _pool(num_blocks=8, block_size=4)
    assert [pool.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    table = pool.allocate(3)
    assert len(table.blocks) == 1 and table.length == 3 and pool.free_blocks == 7
    assert pool.append_slots(table, 1) == 3  # fills the block: nothing taken
    assert len(table.blocks) == 1 and pool.free_blocks == 7
    assert pool.blocks_to_append(table, 1) == 1
    assert pool.append_slots(table, 1) == 4  # row 4 opens a second block
    assert len(table.blocks) == 2 and pool.free_blocks == 6
    assert pool.append_slots(table, 7) == 5  # rows 5..11: through the third block exactly
    assert table.length == 12 and len(table.blocks) == 3 and pool.free_blocks == 5
    empty = pool.allocate(0)
    assert empty.blocks == [] and pool.free_blocks == 5


def test_out_of_blocks_raises_and_changes_nothing() -> None:
    pool = _pool(num_blocks=4, block_size=4)
    a = pool.allocate(10)  # 3 blocks
    assert pool.can_fit(4) and not pool.can_fit(5)
    before = _state(pool, a)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(5)
    with pytest.raises(OutOfBlocksError):
        pool.append_slots(a, 7)  # rows 10..16 need two more blocks, one is free
    assert _state(pool, a) == before
    pool.append_slots(a, 6)  # rows 10..15: exactly the last block
    assert pool.free_blocks == 0 and a.length == 16


def test_double_free_raises_and_leaves_the_free_list_alone() -> None:
    pool = _pool(num_blocks=6, block_size=4)
    a, b = pool.allocate(8), pool.allocate(4)
    stale = BlockTable(a.table_id, list(a.blocks), a.length)  # a copy a caller might keep
    pool.free(a)
    assert a.blocks == [] and a.length == 0 and pool.free_blocks == 5
    c = pool.allocate(8)  # takes a's old blocks back
    assert sorted(c.blocks) == sorted(stale.blocks)
    before = _state(pool, b, c)
    with pytest.raises(BlockTableError):
        pool.free(a)
    with pytest.raises(BlockTableError):
        pool.free(stale)  # would free c's blocks out from under it
    with pytest.raises(BlockTableError):
        pool.append_slots(a, 1)
    assert _state(pool, b, c) == before
    pool.free(b)
    pool.free(c)
    assert pool.free_blocks == 6


def test_freed_blocks_are_reused_first() -> None:
    pool = _pool(num_blocks=8, block_size=4)
    a = pool.allocate(8)
    b = pool.allocate(4)
    a_blocks = list(a.blocks)
    pool.free(a)
    c = pool.allocate(8)
    assert set(c.blocks) == set(a_blocks) and not set(c.blocks) & set(b.blocks)


def _fragmented(pool: BlockPool) -> list[BlockTable]:
    """Three live sequences whose blocks interleave: allocations between frees leave the free
    list in no particular order, and each sequence grows while the others hold blocks."""
    a, filler, b = pool.allocate(5), pool.allocate(6), pool.allocate(3)
    pool.free(filler)
    c = pool.allocate(2)
    pool.append_slots(a, 6)
    pool.append_slots(b, 9)
    pool.append_slots(c, 7)
    return [a, b, c]


def test_fragmentation_scatters_blocks() -> None:
    tables = _fragmented(_pool(num_blocks=12, block_size=4))
    assert any(t.blocks != list(range(t.blocks[0], t.blocks[0] + len(t.blocks))) for t in tables)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_then_gather_round_trips_across_blocks(dtype: torch.dtype) -> None:
    pool = _pool(num_blocks=12, block_size=4, dtype=dtype)
    tables = _fragmented(pool)
    sources = []
    for i, table in enumerate(tables):
        keys, values = _rows(table.length, seed=i, dtype=dtype)
        # in two writes that split mid-block, as a prefill and then decode steps would
        cut = table.length // 2 + 1
        pool.write(table, 0, keys[:, :cut], values[:, :cut])
        pool.write(table, cut, keys[:, cut:], values[:, cut:])
        sources.append((keys, values))
    for table, (keys, values) in zip(tables, sources, strict=True):
        got_k, got_v = pool.gather(table)
        assert got_k.is_contiguous() and got_v.is_contiguous()
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)


def test_write_refuses_rows_it_cannot_place() -> None:
    pool = _pool()
    table = pool.allocate(5)
    keys, values = _rows(3, seed=0)
    with pytest.raises(ValueError, match="outside"):
        pool.write(table, 3, keys, values)
    with pytest.raises(ValueError, match="L, n, Hkv, D"):
        pool.write(table, 0, keys[:2], values[:2])
    with pytest.raises(ValueError, match="pool"):
        pool.write(table, 0, keys.double(), values.double())


def test_table_tensor_pads_and_lengths() -> None:
    pool = _pool(num_blocks=12, block_size=4)
    tables = _fragmented(pool)
    got = pool.table_tensor(tables)
    assert got.dtype == torch.int32 and got.shape == (3, max(len(t.blocks) for t in tables))
    for row, table in zip(got.tolist(), tables, strict=True):
        assert row[: len(table.blocks)] == table.blocks and all(b == 0 for b in row[len(table.blocks):])
    assert pool.table_tensor(tables, width=6).shape == (3, 6)
    with pytest.raises(ValueError, match="narrower"):
        pool.table_tensor(tables, width=1)
    lengths = pool.lengths(tables)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [t.length for t in tables]


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(d)) v of one query [Hq, D] over rows [n, Hkv, D] (the last
    `window` only), GQA by integer division of the head index."""
    if window is not None:
        keys, values = keys[-window:], values[-window:]
    group = q.shape[0] // keys.shape[1]
    outs = []
    for h in range(q.shape[0]):
        scores = keys[:, h // group].double() @ q[h].double() / q.shape[1] ** 0.5
        outs.append(torch.softmax(scores, dim=0) @ values[:, h // group].double())
    return torch.stack(outs)


@pytest.mark.parametrize("window", [None, 3])
def test_paged_reference_equals_dense_attention_over_gathered_rows(window: int | None) -> None:
    pool = _pool(num_blocks=12, block_size=4)
    tables = _fragmented(pool)
    for i, table in enumerate(tables):
        pool.write(table, 0, *_rows(table.length, seed=10 + i))
    q = torch.randn(len(tables), 4, 8, generator=torch.Generator().manual_seed(3))
    layer = 1
    key_blocks, value_blocks = pool.layer(layer)
    args = (q, key_blocks, value_blocks, pool.table_tensor(tables), pool.lengths(tables), 8**-0.5, window)
    got = paged_decode_attention_reference(*args)
    assert torch.equal(dispatch.paged_decode_attention(*args, backend="torch"), got)
    for b, table in enumerate(tables):
        keys, values = pool.gather(table)
        expected = _dense(q[b], keys[layer], values[layer], window)
        torch.testing.assert_close(got[b].double(), expected, atol=2e-6, rtol=1e-5)
