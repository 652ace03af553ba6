"""ragcache's native fp32 CPU attention (kernels/cpu_attention_f32.c, AVX2 + FMA) against fp32
references.

Both compute in fp32; they differ only in summation order (and the online softmax's rescaling),
so the kernel is held to a tight absolute tolerance, and the engine built on it to the same
guards as the torch path: fusion at ratio 1.0 == full prefill, full prefill == transformers."""

from __future__ import annotations

import pytest
import torch

from engine_sidecar.execution.batched_decode import decode_batch
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import FullPolicy
from engine_sidecar.model.runner import ModelRunner
from ragcache_kernels import cpu_native, dispatch
from ragcache_kernels.attention import selective_attention, single_query_attention
from tests.conftest import make_tiny_model
from tests.kernels.kernel_cases import dense_attention

REASON = cpu_native.unsupported_reason(dtype=torch.float32)
# skipped only where the machine cannot have the kernel; where it can, a broken build fails here
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native fp32 CPU attention: {REASON}")
TOL = 2e-5  # fp32 summation-order differences on unit-scale inputs


def test_the_fp32_kernel_builds_and_loads_here():
    assert cpu_native.build(dtype=torch.float32).is_file()
    assert cpu_native.available(torch.float32)


def _reference(q, k, v, query_pos, key_pos):
    return dense_attention(q, k, v, query_pos, key_pos)[0].float()


def _inputs(tq, tk, heads, kv_heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, heads, dim, generator=gen)
    k = torch.randn(tk, kv_heads, dim, generator=gen)
    v = torch.randn(tk, kv_heads, dim, generator=gen)
    return q, k, v, gen


@pytest.mark.parametrize("tq,tk,heads,kv_heads,dim,layout", [
    (100, 100, 9, 3, 64, "dense"),      # full prefill, a partial last block of queries and keys
    (257, 257, 4, 4, 32, "dense"),      # no GQA, head_dim 32
    (300, 1000, 9, 3, 64, "subset"),    # a fused prefill's recomputed tokens, in position order
    (37, 500, 8, 2, 128, "subset"),     # head_dim 128, four heads per KV head
    (50, 400, 6, 3, 96, "shuffled"),    # queries in any order
    (64, 200, 2, 1, 64, "gaps"),        # key positions ascending with holes
    (5, 7, 2, 1, 32, "subset"),
    (1, 33, 2, 2, 64, "dense_last"),    # one query at the end: a partial second key block
])
def test_prefill_matches_the_reference(tq, tk, heads, kv_heads, dim, layout):
    q, k, v, gen = _inputs(tq, tk, heads, kv_heads, dim, seed=tq + tk)
    key_pos = torch.arange(tk)
    if layout == "gaps":
        key_pos = torch.sort(torch.randperm(3 * tk, generator=gen)[:tk]).values
    if layout == "dense":
        query_pos = key_pos
    elif layout == "dense_last":
        query_pos = key_pos[-tq:]
    else:
        query_pos = key_pos[torch.sort(torch.randperm(tk, generator=gen)[:tq]).values]
    if layout == "shuffled":
        query_pos = query_pos[torch.randperm(tq, generator=gen)]
    out = cpu_native.prefill_attention(q, k, v, query_pos, key_pos)
    assert out is not None and out.dtype == torch.float32 and out.shape == q.shape
    exact = _reference(q, k, v, query_pos, key_pos)
    assert (out - exact).abs().max().item() <= TOL
    torch_error = (selective_attention(q, k, v, query_pos, key_pos) - exact).abs().max().item()
    assert (out - exact).abs().max().item() <= max(4 * torch_error, TOL)


def test_large_scores_do_not_overflow_the_softmax():
    """Scores of ~±300 (the online softmax's rescaling and the exp clamp at work)."""
    q, k, v, _ = _inputs(40, 150, 4, 2, 64, seed=9)
    q = q * 6.0
    k = k * 6.0
    pos = torch.arange(150)
    out = cpu_native.prefill_attention(q, k, v, pos[-40:], pos)
    exact = _reference(q, k, v, pos[-40:], pos)
    assert torch.isfinite(out).all() and (out - exact).abs().max().item() <= 1e-4


def test_prefill_reads_strided_queries_and_kv_rows():
    """q as a view into a fused qkv output, k/v as a slice of a longer buffer (the executor's case)."""
    tq, heads, kv_heads, dim = 70, 4, 2, 64
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tq, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].view(tq, heads, dim)
    buffer = torch.randn(2, 128, kv_heads, dim, generator=gen)
    k, v = buffer[0, :tq], buffer[1, :tq]
    pos = torch.arange(tq)
    expected = cpu_native.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), pos, pos)
    assert torch.equal(cpu_native.prefill_attention(q, k, v, pos, pos), expected)


def test_a_query_that_sees_no_key_gets_zeros():
    q, k, v, _ = _inputs(3, 10, 2, 1, 32, seed=3)
    out = cpu_native.prefill_attention(q, k, v, torch.tensor([-1, 4, 9]), torch.arange(10))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()


def test_dispatch_routes_fp32_cpu_attention_to_the_kernel_and_falls_back_where_it_cannot(monkeypatch):
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    q, k, v, _ = _inputs(40, 90, 4, 2, 64, seed=5)
    key_pos, query_pos = torch.arange(90), torch.arange(50, 90)
    native = cpu_native.prefill_attention(q, k, v, query_pos, key_pos)
    assert torch.equal(dispatch.selective_attention(q, k, v, query_pos, key_pos), native)
    # keys out of order, a sliding window, fp64, or the kernel turned off: torch's path, exactly
    shuffled = torch.randperm(90, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dispatch.selective_attention(q, k, v, query_pos, shuffled),
                       selective_attention(q, k, v, query_pos, shuffled))
    assert torch.equal(dispatch.selective_attention(q, k, v, query_pos, key_pos, sliding_window=16),
                       selective_attention(q, k, v, query_pos, key_pos, 16))
    assert cpu_native.prefill_attention(q.double(), k.double(), v.double(), query_pos, key_pos) is None
    # a dense causal fp32 prefill stays on PyTorch's flash SDPA (as fast or faster there)
    qd, kd, vd, _ = _inputs(90, 90, 4, 2, 64, seed=6)
    assert torch.equal(dispatch.selective_attention(qd, kd, vd, key_pos, key_pos, dense_causal=True),
                       selective_attention(qd, kd, vd, key_pos, key_pos, dense_causal=True))
    assert dispatch.decode_attention(q[:2].contiguous(), [k, k], [v, v]) is not None
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert torch.equal(dispatch.selective_attention(q, k, v, query_pos, key_pos),
                       selective_attention(q, k, v, query_pos, key_pos))
    assert dispatch.decode_attention(q[:2].contiguous(), [k, k], [v, v]) is None


def test_on_amx_cpus_fp32_scattered_queries_go_to_torch(monkeypatch):
    """This kernel is AVX2: on the AMX Xeon torch's full-width AVX-512 SDPA is measured faster on
    scattered queries too, so "auto" takes it there; RAGCACHE_CPU_KERNELS=1 takes the kernel anyway."""
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "amx_bf16"}))
    q, k, v, _ = _inputs(40, 90, 4, 2, 64, seed=5)
    key_pos, query_pos = torch.arange(90), torch.arange(50, 90)
    torch_out = selective_attention(q, k, v, query_pos, key_pos)
    assert torch.equal(dispatch.selective_attention(q, k, v, query_pos, key_pos), torch_out)
    monkeypatch.setenv(cpu_native.ENV_VAR, "1")
    native = cpu_native.prefill_attention(q, k, v, query_pos, key_pos)
    assert not torch.equal(native, torch_out)
    assert torch.equal(dispatch.selective_attention(q, k, v, query_pos, key_pos), native)


@pytest.mark.parametrize("lengths", [(1, 7, 17, 600), (1500, 1200, 900, 1600, 1400, 1000, 1300, 1100)])
def test_decode_matches_the_reference_and_the_torch_path(lengths):
    heads, kv_heads, dim = 9, 3, 64
    gen = torch.Generator().manual_seed(len(lengths))
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    buffers = [torch.randn(2, n + 5, kv_heads, dim, generator=gen) for n in lengths]
    keys = [b[0, :n] for b, n in zip(buffers, lengths, strict=True)]  # rows of a longer buffer
    values = [b[1, :n] for b, n in zip(buffers, lengths, strict=True)]
    out = cpu_native.decode_attention(q, keys, values)
    assert out is not None and out.shape == (len(lengths), heads * dim)
    for i, n in enumerate(lengths):
        exact = _reference(q[i : i + 1], keys[i], values[i], torch.tensor([n]), torch.arange(n))[0].reshape(-1)
        assert (out[i] - exact).abs().max().item() <= TOL
        assert (out[i] - single_query_attention(q[i], keys[i], values[i], None)).abs().max().item() <= TOL


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 8, 32), (8, 2, 128), (10, 2, 96), (16, 2, 64),
                                                        (16, 1, 64)])
def test_decode_serves_every_head_group_and_head_size(heads, kv_heads, dim):
    """Groups of 1, 4, 5, 8 and 16 query heads per KV head (heads are served three at a time from
    one pass over the values) and head sizes 32-128 (four vectors of dims at a time)."""
    lengths = (3, 8, 41)
    gen = torch.Generator().manual_seed(heads * dim)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    keys = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    values = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    out = cpu_native.decode_attention(q, keys, values)
    assert out is not None
    for i, n in enumerate(lengths):
        exact = _reference(q[i : i + 1], keys[i], values[i], torch.tensor([n]), torch.arange(n))[0].reshape(-1)
        assert (out[i] - exact).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def runner32(tmp_path_factory):
    """A tiny Llama with head_dim 32 (the kernel's smallest) in fp32."""
    folder = make_tiny_model(tmp_path_factory.mktemp("hd32"), "llama", hidden_size=128, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=256)
    return ModelRunner.load(folder, device="cpu", dtype="float32")


def _prefill(runner, ids):
    plan = FusionPlan([PlanSpan("question", 0, tuple(ids), "fresh")], "full")
    return fused_prefill(runner, plan, FullPolicy(), capacity=len(ids) + 1)


def test_engine_fp32_prefill_and_decode_with_the_kernel_match_the_torch_path(runner32, monkeypatch):
    ids = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    results = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(cpu_native.ENV_VAR, mode)
        result = _prefill(runner32, ids)
        steps = [decode_batch(runner32, [result.kv], [7])[0]]
        steps.append(decode_batch(runner32, [result.kv], [9])[0])
        results[mode] = (result.logits, steps)
    (native, native_steps), (torch_logits, torch_steps) = results["1"], results["0"]
    assert (native - torch_logits).abs().max().item() <= 1e-4
    for a, b in zip(native_steps, torch_steps, strict=True):
        assert (a - b).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def smol_fp32_engine(smol_dir, tmp_path_factory):
    from engine_sidecar import Engine

    engine = Engine.from_pretrained(smol_dir, device="cpu", dtype="float32",
                                    cache_dir=tmp_path_factory.mktemp("kv"), prefix_tree=False)
    yield engine
    engine.close()


def test_real_model_fp32_guards_hold_with_the_kernel(smol_fp32_engine, smol_dir, monkeypatch):
    """SmolLM2 in fp32 through the kernel (fused prefill with cached chunks, batched decode):
    fusion at ratio 1.0 gives full prefill's logits, full prefill gives transformers' within fp32
    noise and the same answer, greedy, token for token."""
    from transformers import AutoModelForCausalLM

    from ragcache_integrations import ChunkedPrompt

    assert cpu_native.available(torch.float32)
    monkeypatch.setenv(cpu_native.ENV_VAR, "1")  # the kernel's path, on CPUs where "auto" prefers torch's
    passages = ["The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean. " * 4,
                "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres. " * 4]
    prompt = ChunkedPrompt(chunks=passages, question="Which river reaches the Atlantic?")
    full, _ = smol_fp32_engine.prefill_logits(prompt, policy="full")
    smol_fp32_engine.warm(passages)
    blended, stats = smol_fp32_engine.prefill_logits(prompt, policy="cacheblend:1.0")
    assert stats.chunk_hits == 2
    assert (full - blended).abs().max().item() <= 1e-3
    ids = torch.tensor(smol_fp32_engine.builder.build(prompt).token_ids)
    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        exact = model(ids[None]).logits[0, -1]
        reference = model.generate(ids[None], max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert (full - exact).abs().max().item() <= 1e-3
    answer = smol_fp32_engine.generate(prompt, {"max_tokens": 12}, policy="full").token_ids
    assert answer == reference[: len(answer)] and len(answer) >= 1
