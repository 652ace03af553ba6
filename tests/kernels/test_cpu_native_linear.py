"""The native CPU linear layer for a decode step's few rows: against a float64 reference (sums in
fp32, rounded once to the dtype: within what torch's own GEMM is off by), with a residual, a bias,
strided rows, every row count it takes, the shapes it refuses, and the dispatch the model calls."""

from __future__ import annotations

import pytest
import torch

from ragcache_kernels import cpu_native, dispatch

DTYPES = [pytest.param(dt, marks=pytest.mark.skipif(cpu_native.unsupported_reason(dtype=dt) is not None,
                                                    reason=f"no native {dt} kernel here"))
          for dt in (torch.float32, torch.bfloat16)]


def _data(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    add = torch.randn(rows, n, generator=gen).to(dtype)
    return x, w, add


def _assert_as_close_as_torch(got: torch.Tensor, torch_result: torch.Tensor, exact: torch.Tensor) -> None:
    """The kernel's largest error against the exact result is within twice torch's GEMM's (its
    summation order differs) plus one rounding step of the dtype."""
    assert got.dtype == torch_result.dtype and got.shape == torch_result.shape
    ulp = torch.finfo(got.dtype).eps * float(exact.abs().max())
    kernel_error = float((got.double() - exact).abs().max())
    torch_error = float((torch_result.double() - exact).abs().max())
    assert kernel_error <= 2 * torch_error + ulp, (kernel_error, torch_error, ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
def test_linear_with_a_residual_matches_the_exact_result(dtype, rows) -> None:
    x, w, add = _data(rows, 96, 576, dtype)
    got = cpu_native.linear(x, w, add, max_rows=cpu_native.LINEAR_MAX_ROWS)
    assert got is not None
    exact = x.double() @ w.double().t() + add.double()
    _assert_as_close_as_torch(got, torch.addmm(add, x, w.t()), exact)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_with_a_bias_and_with_nothing_added(dtype) -> None:
    x, w, _ = _data(2, 64, 128, dtype, seed=1)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(2)).to(dtype)
    with_bias = cpu_native.linear(x, w, bias)
    plain = cpu_native.linear(x, w)
    assert with_bias is not None and plain is not None
    _assert_as_close_as_torch(with_bias, torch.nn.functional.linear(x, w, bias),
                              x.double() @ w.double().t() + bias.double())
    _assert_as_close_as_torch(plain, torch.nn.functional.linear(x, w), x.double() @ w.double().t())


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_reads_strided_rows(dtype) -> None:
    # a gate's half of a fused gate/up projection, and a residual that is a view too
    joint, w, _ = _data(2, 32, 2 * 256, dtype, seed=3)
    gate = joint[:, :256]
    w = w[:, :256].contiguous()
    residual = torch.randn(2, 64, generator=torch.Generator().manual_seed(4)).to(dtype)[:, :32]
    got = cpu_native.linear(gate, w, residual)
    assert got is not None
    _assert_as_close_as_torch(got, torch.addmm(residual, gate, w.t()),
                              gate.double() @ w.double().t() + residual.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_the_kernel_refuses(dtype) -> None:
    x, w, add = _data(2, 64, 128, dtype)
    too_many = torch.randn(cpu_native.LINEAR_MAX_ROWS + 1, 128).to(dtype)
    assert cpu_native.linear(too_many, w) is None
    assert cpu_native.linear(too_many, w, max_rows=too_many.shape[0]) is None  # past what the kernel takes
    assert cpu_native.linear(x[:, :100], w[:, :100].contiguous()) is None  # K not a multiple of the vector
    assert cpu_native.linear(x, w[:60]) is None  # N not a multiple of the block
    assert cpu_native.linear(x, w.t().contiguous().t()) is None  # weight rows not contiguous
    assert cpu_native.linear(x, w, add[:, :32]) is None  # the residual's shape does not match
    assert cpu_native.linear(x.half(), w.half()) is None  # no kernel for the dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_uses_the_kernel_and_falls_back_to_torch(dtype, monkeypatch) -> None:
    x, w, add = _data(2, 64, 128, dtype, seed=5)
    bias = torch.randn(64).to(dtype)
    native = dispatch.linear(x, w, residual=add)
    assert torch.equal(native, cpu_native.linear(x, w, add))
    monkeypatch.setenv("RAGCACHE_KERNELS", "torch")
    assert torch.equal(dispatch.linear(x, w, residual=add), torch.addmm(add, x, w.t()))
    monkeypatch.delenv("RAGCACHE_KERNELS")
    # a bias and a residual together: torch's GEMM, then the bias
    both = dispatch.linear(x, w, bias, residual=add)
    assert torch.equal(both, torch.addmm(add, x, w.t()).add_(bias))
    many = torch.randn(40, 128).to(dtype)
    assert torch.equal(dispatch.linear(many, w, bias), torch.nn.functional.linear(many, w, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_amx_torchs_gemm_takes_three_rows_and_more_of_bf16(dtype, monkeypatch) -> None:
    """On CPUs with AMX torch's bf16 GEMM runs on AMX tiles and is faster from 3 rows on, so
    "auto" hands the kernel at most 2 rows there; fp32 and CPUs without AMX keep 8;
    RAGCACHE_CPU_KERNELS=1 keeps 8 everywhere."""
    x, w, add = _data(4, 64, 128, dtype, seed=6)
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}))
    amx_rows = 2 if dtype == torch.bfloat16 else cpu_native.LINEAR_MAX_ROWS
    assert cpu_native.linear_max_rows(dtype) == amx_rows
    assert (cpu_native.linear(x, w, add) is None) == (dtype == torch.bfloat16)
    if dtype == torch.bfloat16:
        assert torch.equal(dispatch.linear(x, w, residual=add), torch.addmm(add, x, w.t()))
    assert cpu_native.linear(x[:2], w, add[:2]) is not None
    monkeypatch.setenv(cpu_native.ENV_VAR, "1")
    assert cpu_native.linear_max_rows(dtype) == cpu_native.LINEAR_MAX_ROWS
    monkeypatch.delenv(cpu_native.ENV_VAR)
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    assert cpu_native.linear_max_rows(dtype) == cpu_native.LINEAR_MAX_ROWS
    assert cpu_native.linear(x, w, add) is not None
