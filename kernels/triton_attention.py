"""Triton selective attention: scattered queries at global positions over the whole assembled KV.

Flash-style: one program owns BLOCK_M queries of one head and streams key blocks through an
online softmax (running max and normaliser in fp32, exp2 domain). Visibility is by position,
key_pos <= query_pos (and key_pos > query_pos - window), never by index, because the queries are
an arbitrary subset of tokens. Key blocks no query of the block may see are skipped before any
load, which is where a causal-by-position mask saves half the work over a dense masked SDPA.

Optionally the same pass accumulates per-segment attention mass (Cache-Craft's inter/intra
attention): unnormalised probabilities are summed per key segment with a one-hot matmul and
rescaled with the output accumulator, then divided by the final normaliser.

When queries are few (a `reuse` request's question rows, a decode-sized step) query blocks x
heads leave most of a GPU idle, so the keys are split across programs as well (flash-decoding):
each split keeps its own running max, normaliser and unnormalised output, and a second small
kernel merges the splits. Mass accumulation never splits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ragcache_kernels._triton_common import MAX_MASS_SEGMENTS, check_device, dot_in_fp32, interpreting

LOG2E = 1.4426950408889634
# Sizes that change from request to request. Triton compiles a new variant for an int argument
# equal to 1 or divisible by 16 unless told not to: left specialised, a stream of prompts of
# varying lengths compiles many variants of this kernel on one model, each compile landing on
# whichever request meets its shape first. Strides stay specialised: they are fixed per
# model, and their divisibility lets loads vectorise, except those of the splits' partial results,
# which grow with the query count.
SIZES_OF_ATTENTION = ["num_queries", "num_keys", "keys_per_split", "window", "stride_ps", "stride_ms"]
# Sentinel position beyond any real one (positions are int64).
FAR = tl.constexpr(1 << 62)


@triton.jit
def store_queries(OUT, MASS, PART_ACC, PART_ML, acc, seg_acc, m_i, l_i, offs_m, offs_d, seg_cols, m_ok, d_ok, head,
                  split, stride_ot, stride_oh, stride_mt, stride_mh, stride_ps, stride_pt, stride_ms, stride_mtq,
                  HEAD_DIM: tl.constexpr, WITH_MASS: tl.constexpr, SPLIT: tl.constexpr):
    """A query block's result: a split's partial softmax for the merge kernel, else the output
    (and its attention mass) normalised."""
    if SPLIT:
        # this split's running max, normaliser and unnormalised output: the merge kernel's input
        part = split.to(tl.int64) * stride_ps + offs_m.to(tl.int64)[:, None] * stride_pt + head * HEAD_DIM
        tl.store(PART_ACC + part + offs_d[None, :], acc, mask=m_ok[:, None] & d_ok[None, :])
        ml = split.to(tl.int64) * stride_ms + offs_m.to(tl.int64) * stride_mtq + head * 2
        tl.store(PART_ML + ml, m_i, mask=m_ok)
        tl.store(PART_ML + ml + 1, l_i, mask=m_ok)
    else:
        # Rows that saw no key at all get zeros (the torch reference gives NaN there).
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_ptrs = OUT + offs_m.to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
        if WITH_MASS:
            mass_ptrs = MASS + offs_m.to(tl.int64)[:, None] * stride_mt + head * stride_mh + seg_cols[None, :]
            tl.store(mass_ptrs, seg_acc / l_safe[:, None], mask=m_ok[:, None])


@triton.jit
def _attend_block(acc, seg_acc, m_i, l_i, q, qpos, K, V, KPOS, SEG, start, key_hi, kv_head, qk_scale, window,
                  stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok, seg_cols, BLOCK_N: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, WITH_MASS: tl.constexpr, DOT_FP32: tl.constexpr,
                  PRECISION: tl.constexpr, KEYS_AT_INDEX: tl.constexpr, MASKED: tl.constexpr):
    """One key block folded into a query block's online softmax. Unmasked (MASKED false) only where
    every key of the block is in range and visible to every query of the block."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < key_hi
    k_ptrs = K + offs_n.to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        if KEYS_AT_INDEX:
            kpos = offs_n
        else:
            kpos = tl.load(KPOS + offs_n, mask=n_ok, other=0)
        visible = (kpos[None, :] <= qpos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
    # exp2(-inf - -inf) = NaN out of alpha and p.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    v_ptrs = V + offs_n.to(tl.int64)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if DOT_FP32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    if WITH_MASS:
        seg = tl.load(SEG + offs_n, mask=n_ok, other=-1)
        one_hot = (seg[:, None] == seg_cols[None, :]).to(tl.float32)
        # Mass is a statistic people threshold on: keep it in exact fp32, not tf32.
        seg_acc = seg_acc * alpha[:, None] + tl.dot(p, one_hot, input_precision="ieee")
    return acc, seg_acc, m_new, l_i


@triton.jit
def attend_keys_at_index(acc, seg_acc, m_i, l_i, q, qpos, q_lo, q_hi, K, V, KPOS, SEG, key_lo, key_hi, kv_head,
                         qk_scale, window, stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok, seg_cols,
                         BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, WITH_MASS: tl.constexpr,
                         DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Keys [key_lo, key_hi) folded into a query block's online softmax, key i at position i.
    What the block may see is then a range of key blocks known before the loop: the loops carry
    no branch and Triton pipelines their loads. Key blocks wholly before the block's first query
    are visible to every query of it and skip the mask."""
    qpos = qpos.to(tl.int32)
    q_lo = q_lo.to(tl.int32)
    loop_hi = tl.minimum(key_hi, q_hi.to(tl.int32) + 1)
    loop_lo = key_lo
    if HAS_WINDOW:
        loop_lo = tl.maximum(key_lo, ((q_lo - window + 1) // BLOCK_N) * BLOCK_N)
        open_hi = loop_lo
    else:
        open_hi = tl.maximum(loop_lo, tl.minimum(loop_hi, (q_lo // BLOCK_N) * BLOCK_N))
    for start in range(loop_lo, open_hi, BLOCK_N):
        acc, seg_acc, m_i, l_i = _attend_block(
            acc, seg_acc, m_i, l_i, q, qpos, K, V, KPOS, SEG, start, key_hi, kv_head, qk_scale, window,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok, seg_cols, BLOCK_N, HAS_WINDOW,
            WITH_MASS, DOT_FP32, PRECISION, True, False)
    for start in range(open_hi, loop_hi, BLOCK_N):
        acc, seg_acc, m_i, l_i = _attend_block(
            acc, seg_acc, m_i, l_i, q, qpos, K, V, KPOS, SEG, start, key_hi, kv_head, qk_scale, window,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok, seg_cols, BLOCK_N, HAS_WINDOW,
            WITH_MASS, DOT_FP32, PRECISION, True, True)
    return acc, seg_acc, m_i, l_i


@triton.jit(do_not_specialize=SIZES_OF_ATTENTION)
def _selective_attention_kernel(
    Q, K, V, OUT, QPOS, KPOS, SEG, MASS, PART_ACC, PART_ML, num_queries, num_keys, keys_per_split, qk_scale,
    window, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ps, stride_pt, stride_ms, stride_mtq, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_WINDOW: tl.constexpr, WITH_MASS: tl.constexpr, SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, KEYS_AT_INDEX: tl.constexpr
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    key_lo = split * keys_per_split
    key_hi = tl.minimum(key_lo + keys_per_split, num_keys)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < num_queries
    d_ok = offs_d < HEAD_DIM

    qpos = tl.load(QPOS + offs_m, mask=m_ok, other=0)
    q_ptrs = Q + offs_m.to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # Bounds of what this block of queries may see, to skip whole key blocks.
    q_hi = tl.max(tl.where(m_ok, qpos, -FAR), axis=0)
    q_lo = tl.min(tl.where(m_ok, qpos, FAR), axis=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seg_acc = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
    seg_cols = tl.arange(0, BLOCK_S)

    if KEYS_AT_INDEX:
        acc, seg_acc, m_i, l_i = attend_keys_at_index(
            acc, seg_acc, m_i, l_i, q, qpos, q_lo, q_hi, K, V, KPOS, SEG, key_lo, key_hi, kv_head, qk_scale, window,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok, seg_cols, BLOCK_N, HAS_WINDOW, WITH_MASS,
            DOT_FP32, PRECISION)
    else:
        for start in range(key_lo, key_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < key_hi
            kpos = tl.load(KPOS + offs_n, mask=n_ok, other=0)
            k_lo = tl.min(tl.where(n_ok, kpos, FAR), axis=0)
            useful = k_lo <= q_hi
            if HAS_WINDOW:
                k_hi = tl.max(tl.where(n_ok, kpos, -FAR), axis=0)
                useful = useful & (k_hi > q_lo - window)
            if useful:
                acc, seg_acc, m_i, l_i = _attend_block(
                    acc, seg_acc, m_i, l_i, q, qpos, K, V, KPOS, SEG, start, key_hi, kv_head, qk_scale, window,
                    stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok, seg_cols, BLOCK_N, HAS_WINDOW,
                    WITH_MASS, DOT_FP32, PRECISION, False, True)

    store_queries(OUT, MASS, PART_ACC, PART_ML, acc, seg_acc, m_i, l_i, offs_m, offs_d, seg_cols, m_ok, d_ok, head,
                  split, stride_ot, stride_oh, stride_mt, stride_mh, stride_ps, stride_pt, stride_ms, stride_mtq,
                  HEAD_DIM, WITH_MASS, SPLIT)


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ms"])
def merge_splits_kernel(
    PART_ACC,
    PART_ML,
    OUT,
    num_splits,
    stride_ps,
    stride_pt,
    stride_ms,
    stride_mtq,
    stride_ot,
    stride_oh,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    """One (query, head): the splits' partial softmaxes rescaled to their common max and summed."""
    query = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    ml = offs_s.to(tl.int64) * stride_ms + query * stride_mtq + head * 2
    m = tl.load(PART_ML + ml, mask=s_ok, other=float("-inf"))
    l_split = tl.load(PART_ML + ml + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    # every split saw no key: weights of 0 (not exp2(-inf - -inf) = NaN), output zeros
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe)
    total = tl.sum(l_split * weight, axis=0)
    part = offs_s.to(tl.int64)[:, None] * stride_ps + query * stride_pt + head * HEAD_DIM + offs_d[None, :]
    acc = tl.load(PART_ACC + part, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + query * stride_ot + head * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)


# Split the keys until the launch has about this many programs per multiprocessor, never into
# splits of fewer than MIN_SPLIT_BLOCKS key blocks (each split costs a partial row and a merge),
# and into at most MAX_SPLITS.
PROGRAMS_PER_MULTIPROCESSOR = 2
MIN_SPLIT_BLOCKS = 4
MAX_SPLITS = 64
# The merge reads its splits as one tile of this many rows, whatever the count (the rest masked):
# one compiled variant for every split count, where a tile per power of two compiled six.
MERGE_BLOCK_SPLITS = MAX_SPLITS
# The interpreter has no multiprocessors; pretending to a few makes small test launches split.
INTERPRETER_MULTIPROCESSORS = 4


def multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_MULTIPROCESSORS


def key_splits(programs: int, num_keys: int, block_n: int, multiprocessors: int) -> int:
    """How many ways to split the keys of a launch with `programs` (query blocks x heads)."""
    wanted = triton.cdiv(PROGRAMS_PER_MULTIPROCESSOR * multiprocessors, max(programs, 1))
    most = max(1, num_keys // (MIN_SPLIT_BLOCKS * block_n))
    return max(1, min(wanted, most, MAX_SPLITS))


# (BLOCK_M, BLOCK_N, num_warps, num_stages) that `ragcache bench gpu` times against the defaults
# for bf16/fp16 on a card. Each compiles for sm_90 without spilling at head dims 64 and 128
# (`python -m ragcache_kernels.cross_compile` checks them with the engine's own launches): 64 x 128
# and 128 x 64 tiles on four warps spill at 128.
TILE_CANDIDATES = ((64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 32, 8, 3),
                   (128, 64, 8, 4), (128, 128, 8, 2), (32, 64, 4, 3), (16, 64, 4, 3))


def default_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a launch: tiles that compile for sm_90 without spilling registers
    (`python -m ragcache_kernels.cross_compile` reports them per variant); which of the spill-free
    candidates is fastest is what `ragcache bench gpu`'s tile section measures on a card."""
    if interpreting():
        # Small tiles: the interpreter's cost grows with tile area, and tests want many blocks.
        return 16, 16
    if dtype == torch.float32:
        # fp32 dots run on FMA units with every operand in registers: at 64 x 64 ptxas falls
        # back to 32 registers and ~40 KB of spills per thread; these tiles fit without spilling
        return (32 if head_dim <= 64 else 16), 32
    return 64, (64 if head_dim <= 64 else 32)


@functools.lru_cache(maxsize=16)
def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The arguments a launch without mass or splits never reads (mass, segment ids, partials):
    made once per device, since each allocation is host time on a request whose kernels are small.
    Nothing writes them."""
    return (torch.empty(1, 1, 1, dtype=torch.float32, device=device), torch.empty(1, dtype=torch.int32, device=device),
            torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device))


def _mass_buffers(segment_ids: torch.Tensor | None, num_queries: int, heads: int, block_s: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-head mass [Tq, H, block_s], segment ids as int32), or placeholders without mass.
    Mass is kept per head and averaged on the host: deterministic, unlike atomics across heads."""
    if segment_ids is None:
        return _placeholders(device)[:2]
    return (torch.zeros(num_queries, heads, block_s, dtype=torch.float32, device=device),
            segment_ids.to(device=device, dtype=torch.int32).contiguous())


def _partials(splits: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's unnormalised output and (max, normaliser) per query and head, for the merge;
    the shared placeholder when the keys are not split."""
    if splits == 1:
        placeholder = _placeholders(q.device)[2]
        return placeholder, placeholder
    num_queries, heads, head_dim = q.shape
    return (torch.empty(splits, num_queries, heads, head_dim, dtype=torch.float32, device=q.device),
            torch.empty(splits, num_queries, heads, 2, dtype=torch.float32, device=q.device))


def _launch_options(dtype: torch.dtype, num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    if num_stages is None and dtype == torch.float32:
        # fp32 dots hold their operands in registers: pipelined over stages, they spill at head
        # dim 128 (cross_compile reports it); fp32 is the reference dtype on a GPU, not its speed
        num_stages = 1
    return {name: value for name, value in (("num_warps", num_warps), ("num_stages", num_stages))
            if value is not None}


def _split_keys(splits: int, num_keys: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split) for a wish of `splits`: whole key blocks per split, none left
    empty, and no more than the merge's tile holds."""
    splits = min(splits, MAX_SPLITS)
    keys_per_split = triton.cdiv(triton.cdiv(max(num_keys, 1), max(splits, 1)), block_n) * block_n
    return max(1, triton.cdiv(num_keys, keys_per_split)), keys_per_split


def _checked_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q [Tq, H, D], k/v [Tk, Hkv, D] of one dtype, GQA-compatible, each with a unit last stride."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError("expected q [Tq, H, D] and k, v [Tk, Hkv, D]")
    if q.shape[1] % k.shape[1] or k.shape[2] != q.shape[2]:
        raise ValueError(f"bad GQA shapes: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("q, k and v must share a dtype")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    check_device(q, k, v)
    return q, k, v


def selective_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor | None,
    sliding_window: int | None = None,
    scale: float | None = None,
    segment_ids: torch.Tensor | None = None,
    num_segments: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [Tq, H, D], k/v [Tk, Hkv, D] -> (out [Tq, H, D], mass [Tq, num_segments] fp32 or None).

    `key_pos` None: key i is at position i (the fused prefill's layout). The kernel then knows
    before its loop which key blocks each query block may see, and runs a loop without branches.

    Mass is returned when `segment_ids` ([Tk] ints; ids outside [0, num_segments) belong to no
    segment) is given. Inputs may be fp32, fp16 or bf16; scores, softmax and accumulation are fp32.
    `splits` divides the keys among that many programs per query block and head (None: chosen
    from the launch's size and the device's multiprocessors; mass is never split). `block_m`,
    `block_n`, `num_warps` and `num_stages` override the tiles and Triton's launch defaults
    (`ragcache bench gpu` times the candidates in TILE_CANDIDATES this way).
    """
    q, k, v = _checked_inputs(q, k, v)
    num_queries, heads, head_dim = q.shape
    num_keys, kv_heads, _ = k.shape
    with_mass = segment_ids is not None
    if with_mass and not 0 < num_segments <= MAX_MASS_SEGMENTS:
        raise ValueError(f"num_segments must be in 1..{MAX_MASS_SEGMENTS} for the Triton kernel")

    out = torch.empty(num_queries, heads, head_dim, dtype=q.dtype, device=q.device)
    block_s = max(16, triton.next_power_of_2(num_segments)) if with_mass else 16
    mass_heads, seg = _mass_buffers(segment_ids, num_queries, heads, block_s, q.device)
    if num_queries == 0:
        return out, (mass_heads[:, :, :num_segments].mean(1) if with_mass else None)

    default_m, default_n = default_blocks(head_dim, q.dtype)
    block_m, block_n = block_m or default_m, block_n or default_n
    scale = head_dim**-0.5 if scale is None else scale
    query_blocks = triton.cdiv(num_queries, block_m)
    if with_mass:
        splits = 1
    elif splits is None:
        splits = key_splits(query_blocks * heads, num_keys, block_n, multiprocessors(q.device))
    splits, keys_per_split = _split_keys(splits, num_keys, block_n)
    part_acc, part_ml = _partials(splits, q)
    grid = (query_blocks, heads, splits)
    launch = _launch_options(q.dtype, num_warps, num_stages)
    query_pos = query_pos.to(device=q.device, dtype=torch.int64).contiguous()
    keys_at_index = key_pos is None
    key_pos = query_pos if key_pos is None else key_pos.to(device=q.device, dtype=torch.int64).contiguous()
    _selective_attention_kernel[grid](
        q, k, v, out, query_pos, key_pos, seg, mass_heads, part_acc, part_ml,
        num_queries, num_keys, keys_per_split, scale * LOG2E, int(sliding_window or 0), q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        mass_heads.stride(0), mass_heads.stride(1), part_acc.stride(0), part_acc.stride(1),
        part_ml.stride(0), part_ml.stride(1), GROUP=heads // kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_S=block_s, HAS_WINDOW=sliding_window is not None, WITH_MASS=with_mass, SPLIT=splits > 1,
        DOT_FP32=dot_in_fp32(q.dtype),
        # fp32 inputs would otherwise run tf32 dots on GPU (10-bit mantissa) and miss the reference.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KEYS_AT_INDEX=keys_at_index, **launch
    )
    if splits > 1:
        merge_splits_kernel[(num_queries, heads)](
            part_acc, part_ml, out, splits, part_acc.stride(0), part_acc.stride(1), part_ml.stride(0),
            part_ml.stride(1), out.stride(0), out.stride(1), HEADS=heads, HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_SPLITS=MERGE_BLOCK_SPLITS
        )
    mass = mass_heads[:, :, :num_segments].mean(1) if with_mass else None
    return out, mass
