"""The native CPU RoPE: torch's result bit for bit (its roundings, its fused multiply-add), on every
layout the engine hands it, and the dispatch that falls back to torch where it does not apply."""

from __future__ import annotations

import pytest
import torch

from ragcache_kernels import cpu_native, dispatch
from ragcache_kernels.rope import apply_rope, cos_sin, inv_frequencies

DTYPES = [pytest.param(dt, marks=pytest.mark.skipif(cpu_native.unsupported_reason(dtype=dt) is not None,
                                                    reason=f"no native {dt} kernel here"))
          for dt in (torch.float32, torch.bfloat16)]


def tables(tokens: int, dim: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 200_000, (tokens,), generator=torch.Generator().manual_seed(seed))
    cos, sin = cos_sin(positions, inv_frequencies(dim, 500_000.0, "llama3", 8.0))
    return cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 4, 64), (1, 1, 32), (3, 33, 2, 128), (30, 257, 3, 64)])
def test_native_rope_is_torch_bit_for_bit(dtype, shape) -> None:
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 7).to(dtype)
    cos, sin = tables(shape[-3], shape[-1], dtype)
    got = cpu_native.rope(x, cos, sin)
    assert got is not None and torch.equal(got, apply_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_rope_reads_strided_rows_and_writes_into_a_view(dtype) -> None:
    # q and k heads inside a fused projection's rows; the result into a slice of a longer buffer
    joint = (torch.randn(13, 10 * 64, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    qk = joint[:, : 8 * 64].unflatten(-1, (8, 64))
    cos, sin = tables(13, 64, dtype, seed=3)
    assert torch.equal(cpu_native.rope(qk, cos, sin), apply_rope(qk, cos, sin))
    layers = (torch.randn(4, 40, 2, 64, generator=torch.Generator().manual_seed(4))).to(dtype)
    buffer = torch.full((4, 50, 2, 64), 9.0, dtype=dtype)
    cos, sin = tables(30, 64, dtype, seed=5)
    out = cpu_native.rope(layers[:, :30], cos, sin, out=buffer[:, :30])
    assert out is not None and out.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:, :30], apply_rope(layers[:, :30], cos, sin))
    assert bool((buffer[:, 30:] == 9.0).all())  # nothing past the view is touched


def test_layouts_the_kernel_does_not_take_return_none() -> None:
    x = torch.randn(5, 4, 64)
    cos, sin = tables(5, 64, torch.float32)
    assert cpu_native.rope(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin) is None  # heads not dense
    assert cpu_native.rope(x, cos[:4], sin[:4]) is None  # a table per token
    assert cpu_native.rope(x, cos.double(), sin.double()) is None  # tables in another dtype
    assert cpu_native.rope(x.double(), cos.double(), sin.double()) is None  # no float64 kernel
    assert cpu_native.rope(x, cos, sin, out=torch.empty(5, 4, 32)) is None


@pytest.mark.parametrize("kernels", ["0", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_gives_the_reference_with_or_without_the_kernel(monkeypatch, kernels, dtype) -> None:
    monkeypatch.setenv(cpu_native.ENV_VAR, kernels)
    x = (torch.randn(2, 17, 3, 64, generator=torch.Generator().manual_seed(6)) * 2).to(dtype)
    cos, sin = cos_sin(torch.arange(100, 117), inv_frequencies(64, 10_000.0))  # fp32 tables, as the engine holds
    expected = apply_rope(x, cos, sin)
    assert torch.equal(dispatch.apply_rope(x, cos, sin), expected)
    out = torch.empty_like(x)
    assert dispatch.apply_rope(x, cos, sin, out=out) is out and torch.equal(out, expected)
