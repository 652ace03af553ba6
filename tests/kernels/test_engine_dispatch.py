"""The engine's fused prefill through the Triton kernels (CPU interpreter) equals the torch path.

This is the dispatch seam the engine uses on CUDA: RoPE re-rotation, KV row scatter and
selective attention go through `ragcache_kernels.dispatch`, and RAGCACHE_KERNELS forces a backend.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ragcache_integrations import ChunkedPrompt  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
]


@pytest.fixture(scope="module")
def tiny64(smol_dir, tmp_path_factory):
    """A tiny Llama with head_dim 64 (a size the kernels are built for) and GQA ratio 3."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny64"), "llama", tokenizer_from=smol_dir,
                           hidden_size=192, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=2)


@pytest.fixture(scope="module")
def engine64(tiny64, tmp_path_factory):
    from engine_sidecar import Engine

    folder = tiny64
    # no CP-Tree: repeated requests must keep the same plan (promotion would turn fusion exact)
    with Engine.from_pretrained(folder, device="cpu", dtype="float32", prefix_tree=False,
                                cache_dir=tmp_path_factory.mktemp("kv64")) as engine:
        yield engine


@pytest.mark.parametrize("policy", ["full", "reuse", "cacheblend:1.0", "epic:4", "cacheblend:0.3"])
def test_fused_prefill_with_triton_kernels_equals_torch(engine64, policy, monkeypatch):
    prompt = ChunkedPrompt(chunks=PASSAGES, question="Which river reaches the Atlantic?")
    engine64.warm(PASSAGES)
    monkeypatch.setenv("RAGCACHE_KERNELS", "torch")
    reference, _ = engine64.prefill_logits(prompt, policy=policy)
    monkeypatch.setenv("RAGCACHE_KERNELS", "triton")
    kernel, stats = engine64.prefill_logits(prompt, policy=policy)
    if policy not in ("full", "reuse"):
        assert stats.chunk_hits == 2 and stats.tokens_recomputed > 0  # a real fusion ran
    assert torch.allclose(kernel, reference, atol=2e-3, rtol=1e-3), (kernel - reference).abs().max()



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_decode_with_triton_kernels_equals_torch(tiny64, dtype, monkeypatch):
    """Three sequences of different lengths and capacities decode four steps together: the Triton
    path (rows appended and attended in one launch each per layer) gives the torch path's logits
    and writes the same KV rows (equal up to the rounding that attention's summation order leaves
    in the hidden states of the steps before)."""
    from engine_sidecar.execution.batched_decode import decode_batch
    from engine_sidecar.execution.kv_buffer import KVBuffer
    from engine_sidecar.model.runner import ModelRunner
    from ragcache_kernels import dispatch

    runner = ModelRunner.load(tiny64, device="cpu", dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    kvs_torch = []
    for length, capacity in ((5, 9), (17, 17), (1, 4)):  # the middle one must grow on the first step
        kv = KVBuffer.allocate(runner, capacity)
        for t in (kv.keys_pre, kv.keys, kv.values):
            t.copy_(torch.randn(t.shape, generator=gen))
        kv.length = length
        kvs_torch.append(kv)
    kvs_triton = [KVBuffer(kv.keys_pre.clone(), kv.keys.clone(), kv.values.clone(), kv.length) for kv in kvs_torch]
    atol = 2e-3 if dtype == "float32" else 6e-2
    for step in ([11, 12, 13], [40, 41, 42], [7, 8, 9], [100, 200, 300]):
        monkeypatch.setenv("RAGCACHE_KERNELS", "torch")
        reference = decode_batch(runner, kvs_torch, step).float()
        monkeypatch.setenv("RAGCACHE_KERNELS", "triton")
        kernel = decode_batch(runner, kvs_triton, step).float()
        # the step really took the batched kernels (a None here would mean the per-sequence path)
        assert dispatch.batched_decode([kv.keys_pre for kv in kvs_triton], [kv.keys for kv in kvs_triton],
                                       [kv.values for kv in kvs_triton], [kv.length - 1 for kv in kvs_triton]) is not None
        assert torch.allclose(kernel, reference, atol=atol, rtol=1e-2), (kernel - reference).abs().max()
    for a, b in zip(kvs_torch, kvs_triton, strict=True):
        assert a.length == b.length
        for x, y in ((a.keys_pre, b.keys_pre), (a.keys, b.keys), (a.values, b.values)):
            assert torch.allclose(x[:, : a.length].float(), y[:, : b.length].float(), atol=atol, rtol=1e-2)
        assert torch.equal(a.keys_pre[0], b.keys_pre[0])  # layer 0's rows come from the embeddings alone
