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
def engine64(smol_dir, tmp_path_factory):
    """A tiny Llama with head_dim 64 (a size the kernels are built for) and GQA ratio 3."""
    from engine_sidecar import Engine

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny64"), "llama", tokenizer_from=smol_dir,
                             hidden_size=192, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=2)
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
