"""The runner's per-layer steps: one fused q/k/v projection taken and rotated as a whole."""

from __future__ import annotations

import pytest
import torch

from engine_sidecar.model.runner import QKV
from ragcache_kernels.rope import apply_rope, cos_sin, inv_frequencies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_k_rotated_in_one_call_equal_each_rotated_alone(dtype) -> None:
    heads, kv_heads, dim, rows = 6, 2, 64, 11
    g = torch.Generator().manual_seed(0)
    joint = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    qkv = QKV(joint, heads, kv_heads, dim)
    positions = torch.tensor([0, 3, 4, 9, 17, 18, 40, 41, 100, 101, 500])
    cos, sin = cos_sin(positions, inv_frequencies(dim, 10000.0))
    q, k = qkv.rotated(cos.to(dtype), sin.to(dtype))
    assert torch.equal(q, apply_rope(qkv.q, cos, sin))
    assert torch.equal(k, apply_rope(qkv.k, cos, sin))
    # v is the projection's last columns, untouched
    assert torch.equal(qkv.v.flatten(1), joint[:, (heads + kv_heads) * dim :])


def test_taking_rows_takes_them_from_q_k_and_v_alike() -> None:
    heads, kv_heads, dim = 4, 2, 8
    joint = torch.arange(5 * (heads + 2 * kv_heads) * dim, dtype=torch.float32).reshape(5, -1)
    qkv = QKV(joint, heads, kv_heads, dim)
    rows = torch.tensor([0, 2, 4])
    taken = qkv.take(rows)
    assert torch.equal(taken.q, qkv.q[rows]) and torch.equal(taken.k, qkv.k[rows]) and torch.equal(taken.v, qkv.v[rows])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_is_transformers_arithmetic_bit_for_bit(tmp_path, dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engine_sidecar.model.runner import ModelRunner
    from tests.conftest import make_tiny_model

    runner = ModelRunner.load(make_tiny_model(tmp_path, "llama"), device="cpu", dtype=dtype)
    width = runner.config.hidden_size
    reference = LlamaRMSNorm(width, eps=runner.config.rms_norm_eps).to(runner.dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(width, generator=g))
        for rows in (1, 7, 300):
            x = (torch.randn(rows, width, generator=g) * 4).to(runner.dtype)
            assert torch.equal(runner.rms_norm(x, reference.weight), reference(x))
