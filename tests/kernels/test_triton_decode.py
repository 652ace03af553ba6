"""The batched decode kernels against float64 ground truth, run by Triton's CPU interpreter.

Each sequence has its own KV buffers of its own capacity (as the engine allocates them), its own
length, and its new row at its own position; the kernels address them through the per-step table.
Cases: lengths of 1 and lengths that are not multiples of the key tile, GQA ratios 1/3/8, head
dims 64/128, a sliding window, keys split across programs (forced, and chosen), and the rows the
append kernel writes read back by the attention of the same step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import TOL, dense_attention  # noqa: E402

from ragcache_kernels import triton_decode  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
LAYERS = 3


def _buffers(lengths: list[int], kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """Per sequence: keys_pre, keys, values [LAYERS, capacity, kv_heads, dim], random, with a
    capacity a little past its new row (different per sequence, so layer strides differ)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, length in enumerate(lengths):
        shape = (LAYERS, length + 1 + 3 * i, kv_heads, dim)
        out.append(tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(3)))
    return out


def _expected(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int, window: int | None
) -> torch.Tensor:
    """Sequence's one query at `position` over rows 0..position of one layer, float64 [H * D]."""
    key_pos = torch.arange(position + 1)
    out, _ = dense_attention(
        q[None], keys[: position + 1], values[: position + 1], torch.tensor([position]), key_pos, window
    )
    return out.reshape(-1)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 9])
def test_attention_matches_ground_truth(
    dtype: torch.dtype, head_dim: int, gqa: int, window: int | None
) -> None:
    kv_heads = 2
    heads = kv_heads * gqa
    positions = [0, 16, 40, 23]  # one visible key, exactly one tile, several tiles, a ragged tail
    bufs = _buffers(positions, kv_heads, head_dim, dtype, seed=head_dim + gqa)
    q = torch.randn(len(positions), heads, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    step = triton_decode.decode_batch_table(
        [b[0] for b in bufs], [b[1] for b in bufs], [b[2] for b in bufs], positions, window
    )
    layer = 1
    got = triton_decode.decode_attention(step, layer, q)
    assert got.shape == (len(positions), heads * head_dim) and got.dtype == dtype
    for i, pos in enumerate(positions):
        _close(got[i], _expected(q[i], bufs[i][1][layer], bufs[i][2][layer], pos, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_keys_match_one_program(dtype: torch.dtype, splits: int) -> None:
    """Keys sliced across programs and merged give the one-program answer, including slices that
    hold no key for the shorter sequences."""
    positions = [70, 5, 33]
    bufs = _buffers(positions, 2, 64, dtype, seed=splits)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    step = triton_decode.decode_batch_table(
        [b[0] for b in bufs], [b[1] for b in bufs], [b[2] for b in bufs], positions
    )
    whole = triton_decode.decode_attention(step, 2, q, splits=1)
    split = triton_decode.decode_attention(step, 2, q, splits=splits)
    for i, pos in enumerate(positions):
        expected = _expected(q[i], bufs[i][1][2], bufs[i][2][2], pos, None)
        _close(split[i], expected, dtype)
        _close(whole[i], expected, dtype)


def test_chosen_split_is_used_for_few_sequences() -> None:
    """One sequence with many keys leaves the (pretend) multiprocessors idle: the launcher splits."""
    from ragcache_kernels.triton_attention import key_splits, multiprocessors

    assert key_splits(1 * 2, 256, 16, multiprocessors(torch.device("cpu"))) > 1
    bufs = _buffers([255], 2, 64, torch.float32, seed=3)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(2))
    step = triton_decode.decode_batch_table([bufs[0][0]], [bufs[0][1]], [bufs[0][2]], [255])
    got = triton_decode.decode_attention(step, 0, q)
    _close(got[0], _expected(q[0], bufs[0][1][0], bufs[0][2][0], 255, None), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_append_writes_each_sequence_row_and_nothing_else(dtype: torch.dtype) -> None:
    positions = [4, 0, 17]
    bufs = _buffers(positions, 3, 64, dtype, seed=11)
    before = [tuple(t.clone() for t in b) for b in bufs]
    gen = torch.Generator().manual_seed(5)
    # the new rows as views of one projection output, as the model produces them
    fused = torch.randn(3, 3 * 3 * 64, generator=gen).to(dtype)
    k_pre, k_rot, v = (fused[:, i * 192 : (i + 1) * 192].view(3, 3, 64) for i in range(3))
    step = triton_decode.decode_batch_table(
        [b[0] for b in bufs], [b[1] for b in bufs], [b[2] for b in bufs], positions
    )
    triton_decode.append_rows(step, 2, k_pre, k_rot, v)
    for i, pos in enumerate(positions):
        for buf, old, new in zip(bufs[i], before[i], (k_pre, k_rot, v), strict=True):
            expected = old.clone()
            expected[2, pos] = new[i]
            assert torch.equal(buf, expected)


def test_appended_row_is_attended_in_the_same_step() -> None:
    positions = [6, 12]
    bufs = _buffers(positions, 2, 64, torch.float32, seed=4)
    gen = torch.Generator().manual_seed(9)
    k_new, v_new = torch.randn(2, 2, 64, generator=gen) * 4, torch.randn(2, 2, 64, generator=gen)
    q = torch.randn(2, 4, 64, generator=gen)
    step = triton_decode.decode_batch_table(
        [b[0] for b in bufs], [b[1] for b in bufs], [b[2] for b in bufs], positions
    )
    triton_decode.append_rows(step, 0, k_new, k_new, v_new)
    got = triton_decode.decode_attention(step, 0, q)
    for i, pos in enumerate(positions):
        keys, values = bufs[i][1][0].clone(), bufs[i][2][0].clone()
        keys[pos], values[pos] = k_new[i], v_new[i]
        _close(got[i], _expected(q[i], keys, values, pos, None), torch.float32)


def test_bad_batches_are_refused() -> None:
    bufs = _buffers([3, 4], 2, 64, torch.float32, seed=0)
    ks, kp, vs = [b[1] for b in bufs], [b[0] for b in bufs], [b[2] for b in bufs]
    with pytest.raises(ValueError, match="capacity"):
        triton_decode.decode_batch_table(kp, ks, vs, [3, 99])
    with pytest.raises(ValueError, match="one keys_pre"):
        triton_decode.decode_batch_table(kp, ks, vs, [3])
    with pytest.raises(ValueError, match="dtype"):
        triton_decode.decode_batch_table(kp, [ks[0], ks[1].double()], vs, [3, 4])
    step = triton_decode.decode_batch_table(kp, ks, vs, [3, 4])
    with pytest.raises(ValueError, match="do not fit"):
        triton_decode.decode_attention(step, 0, torch.randn(3, 4, 64))
    with pytest.raises(ValueError, match="buffers"):
        triton_decode.decode_attention(step, 0, torch.randn(2, 4, 64, dtype=torch.float16))


def test_bench_gpu_compares_batched_decode_with_per_sequence() -> None:
    """`ragcache bench gpu`'s decode-layer row, on the interpreter with its quick shape: both
    paths agree and the report's table shows the row."""
    from ragcache_lab import gpu

    rows = gpu.batched_decode_bench(torch.device("cpu"), quick=True)
    assert [r["sequences"] for r in rows] == [1, 4]
    assert all(r["max_abs_diff"] < 0.05 and r["batched_ms"] > 0 for r in rows)
    table = gpu.markdown({"machine": {"device": "cpu", "torch": torch.__version__}, "dtype": "bfloat16",
                          "kernels": {"batched_decode_layer": rows}})
    assert "| 4 | 64 |" in table
