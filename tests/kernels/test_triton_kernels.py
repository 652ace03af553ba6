"""Each Triton kernel against its torch reference, run by Triton's CPU interpreter.

Shapes are small (the interpreter executes every program instance in numpy) but chosen to hit
the awkward cases: lengths that are not multiples of the tiles, several query and key blocks,
GQA ratios 1/3/8, head dims 64/128 (and a padded 96 for RoPE), queries at scattered positions
over keys with position gaps or stored out of order, and a sliding window. Tolerances: see
kernel_cases.TOL.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import MASS_TOL, TOL, dense_attention, scattered_case  # noqa: E402

from ragcache_kernels import attention as ref_attention  # noqa: E402
from ragcache_kernels import kv as ref_kv  # noqa: E402
from ragcache_kernels import rope as ref_rope  # noqa: E402
from ragcache_kernels import triton_attention, triton_kv, triton_rope  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


# ---- selective attention -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize(("num_queries", "num_keys", "shuffled"), [(5, 17, True), (23, 40, False)])
@pytest.mark.parametrize("window", [None, 7])
def test_attention_matches_reference(
    dtype: torch.dtype,
    head_dim: int,
    gqa: int,
    num_queries: int,
    num_keys: int,
    shuffled: bool,
    window: int | None,
) -> None:
    kv_heads = 1 if gqa == 8 else 2
    q, k, v, qpos, kpos = scattered_case(
        num_queries,
        num_keys,
        gqa * kv_heads,
        kv_heads,
        head_dim,
        dtype,
        seed=num_keys + gqa + head_dim,
        shuffled_keys=shuffled,
    )
    got, mass = triton_attention.selective_attention(q, k, v, qpos, kpos, sliding_window=window)
    assert mass is None
    _close(got, ref_attention.selective_attention(q, k, v, qpos, kpos, sliding_window=window), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize(
    "boundaries",
    [[0, 9, 20], [4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38]],
    ids=["3seg", "18seg-with-unsegmented-prefix"],
)
def test_attention_mass_matches_reference(dtype: torch.dtype, gqa: int, boundaries: list[int]) -> None:
    kv_heads = 1 if gqa == 8 else 2
    q, k, v, qpos, kpos = scattered_case(21, 39, gqa * kv_heads, kv_heads, 64, dtype, seed=gqa)
    seg = ref_attention.segment_ids_from_boundaries(torch.tensor(boundaries), 39)
    num_segments = len(boundaries)
    got, mass = triton_attention.selective_attention(
        q, k, v, qpos, kpos, segment_ids=seg, num_segments=num_segments
    )
    ref_out, ref_mass = ref_attention.selective_attention_with_mass(q, k, v, qpos, kpos, seg, num_segments)
    _close(got, ref_out, dtype)
    assert mass is not None and mass.shape == (21, num_segments) and mass.dtype == torch.float32
    torch.testing.assert_close(mass, ref_mass, atol=MASS_TOL[0], rtol=MASS_TOL[1])


def test_attention_mass_with_window_against_dense() -> None:
    q, k, v, qpos, kpos = scattered_case(17, 33, 6, 2, 64, torch.float32, seed=11, gapped_keys=False)
    seg = ref_attention.segment_ids_from_boundaries(torch.tensor([0, 10, 25]), 33)
    got, mass = triton_attention.selective_attention(
        q, k, v, qpos, kpos, sliding_window=9, segment_ids=seg, num_segments=3
    )
    expected, probs = dense_attention(q, k, v, qpos, kpos, sliding_window=9)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-4)
    assert mass is not None
    head_avg = probs.mean(0)
    for s in range(3):
        torch.testing.assert_close(mass[:, s].double(), head_avg[:, seg == s].sum(-1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 32), (32, 16), (64, 64)])
def test_attention_tile_sizes_agree(block_m: int, block_n: int) -> None:
    q, k, v, qpos, kpos = scattered_case(37, 37, 3, 3, 64, torch.float32, seed=2, gapped_keys=False)
    got, _ = triton_attention.selective_attention(q, k, v, qpos, kpos, block_m=block_m, block_n=block_n)
    _close(got, ref_attention.selective_attention(q, k, v, qpos, kpos), torch.float32)


def test_attention_strided_views() -> None:
    # q/k/v as slices of fused QKV projections, as a model runner would produce them.
    qkv = torch.randn(29, 6 + 2 + 2, 64)
    q, k, v = qkv[:, :6], qkv[:, 6:8], qkv[:, 8:]
    pos = torch.arange(29)
    got, _ = triton_attention.selective_attention(q[::2], k, v, pos[::2], pos)
    _close(got, ref_attention.selective_attention(q[::2], k, v, pos[::2], pos), torch.float32)


def test_attention_query_that_sees_nothing_gets_zeros() -> None:
    q, k, v, _, _ = scattered_case(3, 20, 2, 1, 64, torch.float32, seed=4, gapped_keys=False)
    key_pos = torch.arange(20) + 10
    query_pos = torch.tensor([5, 12, 29])
    got, _ = triton_attention.selective_attention(q, k, v, query_pos, key_pos)
    assert got[0].eq(0).all()
    expected, _ = dense_attention(q[1:], k, v, query_pos[1:], key_pos)
    torch.testing.assert_close(got[1:].double(), expected, atol=1e-5, rtol=1e-4)



@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize(("shuffled", "window"), [(False, None), (True, None), (False, 11)])
def test_attention_with_keys_split_matches_reference(dtype: torch.dtype, gqa: int, splits: int, shuffled: bool,
                                                     window: int | None) -> None:
    """Keys divided among programs and merged: the same attention (some splits hold keys a query
    may not see, some hold none it may)."""
    q, k, v, qpos, kpos = scattered_case(9, 101, gqa * 2, 2, 64, dtype, seed=splits + gqa, shuffled_keys=shuffled)
    got, _ = triton_attention.selective_attention(q, k, v, qpos, kpos, sliding_window=window, splits=splits)
    _close(got, ref_attention.selective_attention(q, k, v, qpos, kpos, sliding_window=window), dtype)


def test_split_keys_query_that_sees_nothing_gets_zeros() -> None:
    q, k, v, _, _ = scattered_case(3, 70, 2, 1, 64, torch.float32, seed=5, gapped_keys=False)
    key_pos = torch.arange(70) + 10
    query_pos = torch.tensor([5, 12, 79])
    got, _ = triton_attention.selective_attention(q, k, v, query_pos, key_pos, splits=4)
    assert got[0].eq(0).all()
    expected, _ = dense_attention(q[1:], k, v, query_pos[1:], key_pos)
    torch.testing.assert_close(got[1:].double(), expected, atol=1e-5, rtol=1e-4)


def test_few_queries_over_many_keys_split_by_default() -> None:
    """A launch too small to fill the device splits its keys on its own (here: 1 query block x 2
    heads over 200 keys, against the interpreter's pretend multiprocessors), and mass never does."""
    q, k, v, qpos, kpos = scattered_case(3, 200, 2, 2, 64, torch.float32, seed=8)
    block_m, block_n = triton_attention.default_blocks(64, torch.float32)
    assert triton_attention.key_splits(2, 200, block_n, triton_attention.multiprocessors(q.device)) > 1
    assert triton_attention.key_splits(264, 200, block_n, 132) == 1  # enough programs already
    assert triton_attention.key_splits(2, 40, block_n, 132) == 1  # too few keys to be worth it
    got, _ = triton_attention.selective_attention(q, k, v, qpos, kpos)
    _close(got, ref_attention.selective_attention(q, k, v, qpos, kpos), torch.float32)
    seg = ref_attention.segment_ids_from_boundaries(torch.tensor([0, 100]), 200)
    out, mass = triton_attention.selective_attention(q, k, v, qpos, kpos, segment_ids=seg, num_segments=2)
    ref_out, ref_mass = ref_attention.selective_attention_with_mass(q, k, v, qpos, kpos, seg, 2)
    _close(out, ref_out, torch.float32)
    torch.testing.assert_close(mass, ref_mass, atol=MASS_TOL[0], rtol=MASS_TOL[1])

@pytest.mark.parametrize(("dtype", "window", "splits", "num_queries", "ordered"), [
    (torch.float16, None, 1, 37, True), (torch.float16, None, 1, 37, False), (torch.float16, None, 3, 5, True),
    (torch.float16, None, None, 5, True), (torch.float16, 7, 1, 37, True), (torch.float16, 40, 3, 37, False),
    (torch.bfloat16, None, 1, 37, True), (torch.bfloat16, 7, 3, 5, True), (torch.float32, None, 3, 37, False)])
def test_keys_at_their_index_match_the_reference(dtype: torch.dtype, window: int | None, splits: int | None,
                                                 num_queries: int, ordered: bool) -> None:
    """`key_pos` None (key i at position i, the fused prefill's layout): the branch-free loops,
    with the key blocks before a query block's first query unmasked, give the masked result of
    the same keys at explicit positions, split or not, with a window or not."""
    gen = torch.Generator().manual_seed(num_queries + (window or 0) + (splits or 0))
    num_keys = 150  # several key blocks before and inside each query block's span
    picked = torch.randperm(num_keys, generator=gen)[:num_queries]
    query_pos = picked.sort().values if ordered else picked
    q = torch.randn(num_queries, 4, 64, generator=gen).to(dtype)
    k, v = (torch.randn(num_keys, 2, 64, generator=gen).to(dtype) for _ in range(2))
    key_pos = torch.arange(num_keys)
    got, _ = triton_attention.selective_attention(q, k, v, query_pos, None, sliding_window=window, splits=splits)
    expected = ref_attention.selective_attention(q, k, v, query_pos, key_pos, sliding_window=window)
    _close(got, expected, dtype)
    explicit, _ = triton_attention.selective_attention(q, k, v, query_pos, key_pos, sliding_window=window,
                                                       splits=splits)
    _close(got, explicit, dtype)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 32), (32, 16)])
def test_keys_at_their_index_with_mass_and_other_tiles(block_m: int, block_n: int) -> None:
    q, k, v, qpos, kpos = scattered_case(29, 97, 6, 2, 64, torch.float16, seed=3, gapped_keys=False)
    seg = ref_attention.segment_ids_from_boundaries(torch.tensor([0, 30, 61]), 97)
    got, mass = triton_attention.selective_attention(q, k, v, qpos, None, segment_ids=seg, num_segments=3,
                                                     block_m=block_m, block_n=block_n)
    ref_out, ref_mass = ref_attention.selective_attention_with_mass(q, k, v, qpos, kpos, seg, 3)
    _close(got, ref_out, torch.float16)
    # the reference's fp32 scores come from fp16 operands as the kernel's do: mass agrees in fp32
    torch.testing.assert_close(mass, ref_mass, atol=MASS_TOL[0] * 10, rtol=MASS_TOL[1] * 10)


# ---- RoPE re-rotation ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rope_matches_reference(dtype: torch.dtype, head_dim: int, interleaved: bool, rope_type: str) -> None:
    inv = ref_rope.inv_frequencies(
        head_dim, 1e5, rope_type=rope_type, factor=8.0, original_max_position_embeddings=512
    )
    # Three chunks of odd lengths placed at scattered, out-of-order global positions.
    positions = ref_rope.span_positions(torch.tensor([2000, 7, 333]), torch.tensor([13, 5, 21]))
    x = torch.randn(positions.numel(), 3, head_dim).to(dtype)
    got = triton_rope.rotate_keys(x, positions, inv, interleaved)
    _close(got, ref_rope.rotate_keys(x, positions, inv, interleaved), dtype)


def test_rope_linear_scaling_into_a_buffer_slice_and_in_place() -> None:
    inv = ref_rope.inv_frequencies(64, 1e4, rope_type="linear", factor=4.0)
    x = torch.randn(19, 2, 64)
    positions = torch.randint(0, 8000, (19,))
    expected = ref_rope.rotate_keys(x, positions, inv)
    buffer = torch.zeros(3, 40, 2, 64)  # [layers, tokens, heads, dim]; write layer 1, tokens 5..23
    triton_rope.rotate_keys(x, positions, inv, out=buffer[1, 5:24])
    _close(buffer[1, 5:24], expected, torch.float32)
    assert buffer[1, :5].eq(0).all() and buffer[0].eq(0).all()
    same = x.clone()
    triton_rope.rotate_keys(same, positions, inv, out=same)
    _close(same, expected, torch.float32)


def test_rope_of_every_layer_in_one_launch_into_a_buffer_slice() -> None:
    """[layers, T, heads, D] keys, each layer at the same positions, into the first T rows of a
    larger buffer (the fused prefill's rotation of every cached key): each layer as the reference
    rotates it alone, and the rows past T untouched."""
    inv = ref_rope.inv_frequencies(64, 5e5)
    x = torch.randn(3, 40, 2, 64)[:, :23]  # a strided slice, as kv.keys_pre[:, :n]
    positions = torch.randperm(500)[:23]
    buffer = torch.zeros(3, 40, 2, 64)
    triton_rope.rotate_keys(x, positions, inv, out=buffer[:, :23])
    for layer in range(3):
        _close(buffer[layer, :23], ref_rope.rotate_keys(x[layer], positions, inv), torch.float32)
    assert buffer[:, 23:].eq(0).all()


def test_rope_of_query_and_key_heads_of_a_fused_projection() -> None:
    """q and k heads as one strided view of a fused q/k/v projection's rows (QKV.rotated on a GPU)."""
    inv = ref_rope.inv_frequencies(64, 1e4)
    joint = torch.randn(11, (6 + 2 + 2) * 64)
    qk = joint[:, : 8 * 64].unflatten(-1, (8, 64))
    positions = torch.tensor([0, 3, 4, 9, 17, 18, 30, 31, 32, 60, 99])
    _close(triton_rope.rotate_keys(qk, positions, inv), ref_rope.rotate_keys(qk, positions, inv), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    """SwiGLU's activation in one launch, on a strided view (rows of a wider buffer) and over a
    width that is not a multiple of the block: torch's silu-then-product within rounding."""
    from ragcache_kernels import triton_mlp

    wide = (torch.randn(7, 2 * 1500 + 8) * 4).to(dtype)
    gate_up = wide[:, : 2 * 1500]
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate.to(dtype)).float() * up).to(dtype)
    _close(triton_mlp.silu_mul(gate_up), expected, dtype)
    assert triton_mlp.silu_mul(gate_up[:0]).shape == (0, 1500)


# ---- KV deviation, top-k and scatter -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [1, 3])
@pytest.mark.parametrize("indexed", [False, True])
def test_deviation_matches_reference(dtype: torch.dtype, head_dim: int, kv_heads: int, indexed: bool) -> None:
    gen = torch.Generator().manual_seed(head_dim + kv_heads)
    new = torch.randn(37, kv_heads, head_dim, generator=gen).to(dtype)
    cached = torch.randn(45, kv_heads, head_dim, generator=gen).to(dtype)
    index = torch.randperm(45, generator=gen)[:37] if indexed else None
    if not indexed:
        cached = cached[:37]
    got = triton_kv.kv_deviation(new, cached, index)
    # Both sides upcast to fp32 before subtracting, so only the summation order differs.
    torch.testing.assert_close(got, ref_kv.kv_deviation(new, cached, index), atol=1e-5, rtol=1e-5)
    acc = got.clone()
    triton_kv.kv_deviation(new, cached, index, accumulate=acc)
    torch.testing.assert_close(acc, 2 * got, atol=1e-5, rtol=1e-5)


def test_topk_picks_agree_between_backends() -> None:
    new = torch.randn(33, 3, 64, dtype=torch.float16)
    cached = new.clone()
    # Distinct, well separated deviations on a known set, so rounding cannot reorder the picks.
    picked = torch.tensor([0, 4, 5, 17, 31])
    for rank, token in enumerate(picked.tolist()):
        cached[token, rank % 3] += 0.5 * (rank + 1)
    cached += 0.01 * torch.randn_like(cached)
    dev = triton_kv.kv_deviation(new, cached)
    assert ref_kv.topk_tokens(dev, 5).tolist() == picked.tolist()
    assert ref_kv.topk_tokens(ref_kv.kv_deviation(new, cached), 5).tolist() == picked.tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scatter_matches_index_copy(dtype: torch.dtype) -> None:
    buffer = torch.randn(2, 50, 3, 64).to(dtype)  # [layers, tokens, kv heads, dim]
    src = torch.randn(23, 3, 64).to(dtype)
    index = torch.randperm(50)[:23]
    expected = buffer.clone()
    expected[1].index_copy_(0, index, src)
    got = buffer.clone()
    triton_kv.scatter_rows(got[1], index, src)
    assert torch.equal(got, expected)
    # A non-contiguous source (every other row of a bigger tensor) is handled too.
    wide = torch.randn(46, 3, 64).to(dtype)
    triton_kv.scatter_rows(got[0], index, wide[::2])
    expected[0].index_copy_(0, index, wide[::2])
    assert torch.equal(got, expected)


def test_scatter_refuses_non_dense_rows() -> None:
    dst = torch.zeros(10, 64, 4).transpose(1, 2)  # rows are strided
    with pytest.raises(ValueError, match="dense"):
        triton_kv.scatter_rows(dst, torch.tensor([1]), torch.zeros(1, 4, 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_and_store_equals_rotating_and_scattering(dtype: torch.dtype) -> None:
    """One layer's q/k/v rows stored and rotated in one launch: q as rotate_keys rotates it, k as
    computed into keys_pre, k rotated into keys and v into values at the rows' positions; every
    other row of the buffer untouched."""
    heads, kv_heads, dim, total = 6, 2, 64, 70
    rows = torch.tensor([0, 3, 4, 9, 17, 18, 30, 31, 32, 60, 69])
    joint = torch.randn(rows.shape[0], (heads + 2 * kv_heads) * dim).to(dtype)
    inv = ref_rope.inv_frequencies(dim, 5e5)
    buffers = [torch.randn(2, total, kv_heads, dim).to(dtype) for _ in range(3)]
    before = [b.clone() for b in buffers]
    q = triton_rope.rope_and_store(joint, heads, kv_heads, rows, inv, buffers[0][1], buffers[1][1], buffers[2][1])
    q_ref, k_ref, v_ref = joint.unflatten(-1, (heads + 2 * kv_heads, dim)).split((heads, kv_heads, kv_heads), 1)
    _close(q, triton_rope.rotate_keys(q_ref, rows, inv), dtype)
    assert torch.equal(buffers[0][1, rows], k_ref) and torch.equal(buffers[2][1, rows], v_ref)
    _close(buffers[1][1, rows], triton_rope.rotate_keys(k_ref, rows, inv), dtype)
    untouched = torch.ones(total, dtype=torch.bool)
    untouched[rows] = False
    for got, old in zip(buffers, before, strict=True):
        assert torch.equal(got[0], old[0]) and torch.equal(got[1, untouched], old[1, untouched])
