"""Paged decode attention, the Triton kernel under Triton's CPU interpreter and the torch reference,
against float64 ground truth over each sequence's rows gathered block by block.

The pool is poisoned: every row no sequence owns (other blocks, the tail of a partial last block)
holds NaN, and table padding is a block id far outside the pool, so a kernel that loads a row or
a table entry it should mask fails loudly. Blocks are handed out in random order, so a
sequence's rows are never contiguous. Cases: lengths 1, block_size - 1, block_size and several
blocks plus a partial one; GQA ratios 1/4/8; head dims 64/128; fp32/fp16/bf16; keys split across
programs (forced and chosen) and not; sliding windows; pool block sizes below, at and above the
kernel's key tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import TOL, dense_attention  # noqa: E402

from ragcache_kernels import dispatch, triton_paged_decode  # noqa: E402
from ragcache_kernels.paged_decode import paged_decode_attention_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
BLOCK = 16
KV_HEADS = 2
PADDING = 10**6  # a table entry past the pool: dereferencing it would fault


@dataclass
class Case:
    q: torch.Tensor
    key_blocks: torch.Tensor
    value_blocks: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor

    def args(self, window: int | None = None) -> tuple:
        scale = self.q.shape[-1] ** -0.5
        return self.q, self.key_blocks, self.value_blocks, self.tables, self.lengths, scale, window

    def rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's keys and values [n, Hkv, D], block by block through its table."""
        n = int(self.lengths[b])
        blocks = self.tables[b, : -(-n // self.key_blocks.shape[1])].tolist()
        keys = torch.cat([self.key_blocks[i] for i in blocks])[:n] if n else self.key_blocks[0, :0]
        values = torch.cat([self.value_blocks[i] for i in blocks])[:n] if n else self.value_blocks[0, :0]
        return keys, values


def _case(lengths: list[int], gqa: int, head_dim: int, dtype: torch.dtype, seed: int,
          block_size: int = BLOCK) -> Case:
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 3  # blocks nobody owns, poisoned like the rest
    shape = (num_blocks, block_size, KV_HEADS, head_dim)
    key_blocks = torch.full(shape, float("nan"), dtype=dtype)
    value_blocks = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.full((len(lengths), max(needed) + 1), PADDING, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    for b, n in enumerate(lengths):
        blocks, order = order[: needed[b]], order[needed[b]:]
        tables[b, : needed[b]] = torch.tensor(blocks, dtype=torch.int32)
        for row in range(n):
            at = (blocks[row // block_size], row % block_size)
            key_blocks[at] = torch.randn(KV_HEADS, head_dim, generator=gen).to(dtype)
            value_blocks[at] = torch.randn(KV_HEADS, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), KV_HEADS * gqa, head_dim, generator=gen).to(dtype)
    return Case(q, key_blocks, value_blocks, tables, torch.tensor(lengths))


def _expected(case: Case, b: int, window: int | None) -> torch.Tensor:
    """float64 [Hq, D]: sequence b's query, at position length - 1, over its rows."""
    keys, values = case.rows(b)
    n = keys.shape[0]
    out, _ = dense_attention(case.q[b][None], keys, values, torch.tensor([n - 1]), torch.arange(n), window)
    return out[0]


def _check(got: torch.Tensor, case: Case, window: int | None, dtype: torch.dtype) -> None:
    assert got.shape == case.q.shape and got.dtype == dtype
    atol, rtol = TOL[dtype]
    for b in range(case.q.shape[0]):
        torch.testing.assert_close(got[b].double(), _expected(case, b, window), atol=atol, rtol=rtol)


LENGTHS = [1, BLOCK - 1, BLOCK, 3 * BLOCK + 5]  # one row, a partial block, a full one, several + partial


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_matches_ground_truth(dtype: torch.dtype, head_dim: int, gqa: int, splits: int) -> None:
    case = _case(LENGTHS, gqa, head_dim, dtype, seed=head_dim + gqa)
    _check(triton_paged_decode.paged_decode_attention(*case.args(), splits=splits), case, None, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_ground_truth(dtype: torch.dtype, head_dim: int) -> None:
    case = _case(LENGTHS, 4, head_dim, dtype, seed=head_dim)
    _check(paged_decode_attention_reference(*case.args()), case, None, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window", [1, 9, 40])
@pytest.mark.parametrize("splits", [1, 3])
def test_sliding_window(dtype: torch.dtype, window: int, splits: int) -> None:
    """Only the last `window` rows: shorter than a block, across a block edge, and longer than
    some sequences (which then see all their rows)."""
    case = _case([5, 30, 3 * BLOCK + 7], 4, 64, dtype, seed=window)
    _check(triton_paged_decode.paged_decode_attention(*case.args(window), splits=splits), case, window, dtype)
    _check(paged_decode_attention_reference(*case.args(window)), case, window, dtype)


@pytest.mark.parametrize("block_size", [4, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pool_blocks_smaller_and_larger_than_the_key_tile(block_size: int, dtype: torch.dtype) -> None:
    """The kernel's 16-row tiles span several pool blocks, or part of one."""
    case = _case([1, block_size - 1, block_size, 2 * block_size + 3, 45], 4, 64, dtype, seed=block_size,
                 block_size=block_size)
    _check(triton_paged_decode.paged_decode_attention(*case.args(), splits=2, block_n=16), case, None, dtype)
    _check(paged_decode_attention_reference(*case.args()), case, None, dtype)


def test_chosen_splits_for_few_long_sequences() -> None:
    """One long sequence leaves the (pretend) multiprocessors idle: the launcher slices its keys,
    sizing the slices from the table's width (no device sync)."""
    from ragcache_kernels.triton_attention import key_splits, multiprocessors

    case = _case([250], 2, 64, torch.float32, seed=5)
    assert key_splits(KV_HEADS, case.tables.shape[1] * BLOCK, 16, multiprocessors(torch.device("cpu"))) > 1
    _check(triton_paged_decode.paged_decode_attention(*case.args()), case, None, torch.float32)


def test_empty_sequence_gets_zeros_on_both_paths() -> None:
    case = _case([0, 7], 4, 64, torch.float32, seed=2)
    for splits in (1, 2):
        got = triton_paged_decode.paged_decode_attention(*case.args(), splits=splits)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.equal(paged_decode_attention_reference(*case.args())[0], torch.zeros_like(case.q[0]))


def test_dispatch_runs_the_kernel_when_forced_and_the_reference_on_cpu() -> None:
    case = _case([3, 20], 4, 64, torch.float32, seed=8)
    forced = dispatch.paged_decode_attention(*case.args(), backend="triton")
    assert torch.equal(forced, triton_paged_decode.paged_decode_attention(*case.args()))
    auto = dispatch.paged_decode_attention(*case.args(), backend="auto")
    assert torch.equal(auto, paged_decode_attention_reference(*case.args()))
    _check(forced, case, None, torch.float32)


def test_kernel_reads_a_block_pool_in_place() -> None:
    """Rows written through `BlockPool` and its padded table tensor: the kernel on one layer's
    block views equals the reference."""
    from engine_sidecar.execution.block_pool import BlockPool

    @dataclass(frozen=True)
    class Geometry:
        num_layers: int = 2
        num_kv_heads: int = KV_HEADS
        head_dim: int = 64

    pool = BlockPool(Geometry(), torch.float32, "cpu", block_size=8, num_blocks=10)
    gen = torch.Generator().manual_seed(4)
    a, b = pool.allocate(11), pool.allocate(5)
    pool.append_slots(a, 10)  # a's third block comes after b's
    tables = [a, b]
    for table in tables:
        rows = (torch.randn(2, table.length, KV_HEADS, 64, generator=gen) for _ in range(2))
        pool.write(table, 0, *rows)
    q = torch.randn(2, 8, 64, generator=gen)
    args = (q, *pool.layer(1), pool.table_tensor(tables), pool.lengths(tables), 0.125)
    got = triton_paged_decode.paged_decode_attention(*args, splits=2)
    torch.testing.assert_close(got, paged_decode_attention_reference(*args), atol=2e-5, rtol=1e-4)


def test_bad_inputs_are_refused() -> None:
    case = _case([3, 4], 4, 64, torch.float32, seed=0)
    q, kb, vb, tables, lengths, scale, _ = case.args()
    run = triton_paged_decode.paged_decode_attention
    with pytest.raises(ValueError, match="do not fit"):
        run(torch.randn(2, 3, 64), kb, vb, tables, lengths, scale)
    with pytest.raises(ValueError, match="queries are"):
        run(q.half(), kb, vb, tables, lengths, scale)
    with pytest.raises(ValueError, match="per sequence"):
        run(q, kb, vb, tables[:1], lengths, scale)
    with pytest.raises(ValueError, match="window"):
        run(q, kb, vb, tables, lengths, scale, 0)
