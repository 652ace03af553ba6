"""Triton SwiGLU activation: silu(gate) * up from the fused gate/up projection in one launch.

torch takes two (an in-place silu, then the product) and a decode step or a reused request's few
rows spends more host time launching them than the GPU spends running them. Arithmetic as torch's:
silu in fp32, rounded to the activations' dtype, then the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ragcache_kernels._triton_common import check_device

BLOCK = 1024


@triton.jit(do_not_specialize=["rows"])
def _silu_mul_kernel(X, OUT, rows, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + width + cols, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(OUT + row * stride_o + cols, act.to(OUT.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] (gate, then up) -> silu(gate) * up [M, I], a new contiguous tensor."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"expected [rows, 2 * intermediate], got {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    check_device(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width, BLOCK))](gate_up, out, rows, width, gate_up.stride(0),
                                                            out.stride(0), BLOCK=BLOCK)
    return out
