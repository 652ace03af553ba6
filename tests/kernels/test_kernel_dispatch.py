"""Backend selection in ragcache_kernels.dispatch, and each dispatched op on both backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from kernel_cases import TOL, scattered_case

from ragcache_kernels import dispatch
from ragcache_kernels.attention import segment_ids_from_boundaries
from ragcache_kernels.rope import inv_frequencies


def test_auto_uses_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.resolve_backend("cpu") == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert dispatch.resolve_backend("cpu") == "torch"


def test_argument_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.resolve_backend("cpu", backend="torch") == "torch"


def test_bad_backend_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="one of"):
        dispatch.resolve_backend("cpu")


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.resolve_backend("cpu") == "triton"  # conftest set TRITON_INTERPRET=1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.resolve_backend("cpu")


def test_forced_triton_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="import triton"):
        dispatch.resolve_backend("cpu", backend="triton")
    assert dispatch.resolve_backend("cuda", backend="auto") == "torch"


def test_every_op_agrees_across_backends() -> None:
    pytest.importorskip("triton")
    dtype = torch.float16
    atol, rtol = TOL[dtype]

    def both(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return fn(*args, backend="torch", **kwargs), fn(*args, backend="triton", **kwargs)

    q, k, v, qpos, kpos = scattered_case(11, 26, 6, 2, 64, dtype, seed=9)
    a, b = both(dispatch.selective_attention, q, k, v, qpos, kpos, sliding_window=8)
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)

    seg = segment_ids_from_boundaries(torch.tensor([0, 8, 16]), 26)
    (out_a, mass_a), (out_b, mass_b) = both(
        dispatch.selective_attention_with_mass, q, k, v, qpos, kpos, seg, 3
    )
    torch.testing.assert_close(out_a.float(), out_b.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(mass_a, mass_b, atol=2e-5, rtol=1e-4)

    inv = inv_frequencies(64, 1e5)
    a, b = both(dispatch.rotate_keys, k, kpos, inv, interleaved=True)
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)

    k2, v2 = k + 0.1 * torch.randn_like(k), v.clone()
    (idx_a, dev_a), (idx_b, dev_b) = both(dispatch.kv_deviation_topk, k2, k, v2, v, 5)
    torch.testing.assert_close(dev_a, dev_b, atol=1e-5, rtol=1e-5)
    assert idx_a.tolist() == sorted(idx_a.tolist()) and len(idx_a) == 5
    assert idx_a.tolist() == idx_b.tolist()

    index = torch.tensor([3, 0, 7])
    a, b = both(dispatch.scatter_rows, torch.zeros(9, 2, 64, dtype=dtype), index, k[:3])
    assert torch.equal(a, b)


def test_dense_causal_stays_on_torch_in_auto_mode() -> None:
    # On CPU this is torch anyway; the check is that the flag is accepted by every backend choice.
    q, k, v, _, _ = scattered_case(9, 9, 2, 2, 64, torch.float32, seed=1)
    pos = torch.arange(9)
    dense = dispatch.selective_attention(q, k, v, pos, pos, dense_causal=True, backend="auto")
    masked = dispatch.selective_attention(q, k, v, pos, pos, backend="torch")
    torch.testing.assert_close(dense, masked, atol=1e-5, rtol=1e-4)


def test_row_scatter_is_torch_in_auto_mode_even_on_cuda(monkeypatch) -> None:
    # the Triton scatter measured slower than index_copy_ on an H100: "auto" never picks it
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.scatter_backend(torch.device("cuda"), dense_rows=True) == "torch"
    assert dispatch.scatter_backend(torch.device("cuda"), dense_rows=True, backend="triton") == "triton"
    assert dispatch.scatter_backend(torch.device("cuda"), dense_rows=False, backend="triton") == "torch"
