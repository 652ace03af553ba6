"""What one decoder layer computes, owned by the model: each family's layer is a class here or in
its module under `model/families/`. Prefill, batched decode, the prefill graphs and the question
probe call these three steps and never ask which family they run:

- `qkv(hidden)`: the input norm and the q/k/v projection, keys before RoPE (position-free: what the
  chunk store keeps; any q/k norm is applied here, before rotation);
- `attn_out(hidden, attn)`: the output projection and its residual;
- `mlp(hidden)`: the MLP (or the routed experts) and its residual.

Shapes are per sequence: hidden [T, hidden], attention output [T, H * D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragcache_kernels.dispatch import apply_rope, linear, rotate_keys, silu_mul


class QKV:
    """q, k (before RoPE) and v of some rows, as views into one fused projection `joint`
    [A, (H + 2 * Hkv) * D]: rows are taken once for all three, and q and k, adjacent in it, are
    rotated by one RoPE call."""

    def __init__(self, joint: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        self.joint, self.num_heads, self.num_kv_heads, self.head_dim = joint, num_heads, num_kv_heads, head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = joint.split((q_size, kv_size, kv_size), dim=-1)
        self.q = q.unflatten(-1, (num_heads, head_dim))
        self.k = k.unflatten(-1, (num_kv_heads, head_dim))
        self.v = v.unflatten(-1, (num_kv_heads, head_dim))

    @property
    def qk(self) -> torch.Tensor:
        """q's and k's heads side by side [A, H + Hkv, D], a view into `joint`."""
        heads = self.num_heads + self.num_kv_heads
        return self.joint[:, : heads * self.head_dim].unflatten(-1, (heads, self.head_dim))

    def take(self, rows: torch.Tensor) -> QKV:
        """These rows (indices) of q, k and v, in one gather."""
        return QKV(self.joint[rows], self.num_heads, self.num_kv_heads, self.head_dim)

    def rotated(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [A, H, D] and k [A, Hkv, D] rotated by per-row tables [A, D], in one call (cos/sin
        already in the activations' dtype spare the call its two conversions). With the rows'
        `positions` and the layer's `inv_freq`, a GPU rotates them in one Triton launch instead
        (cos/sin computed in fp32 in registers). Views, rows not contiguous."""
        qk = self.qk
        if positions is not None and inv_freq is not None:
            out = rotate_keys(qk, positions, inv_freq, tables=(cos, sin))
        else:
            out = apply_rope(qk, cos, sin)
        return out[:, : self.num_heads], out[:, self.num_heads :]


@dataclass
class RMSNorm:
    """RMSNorm as transformers' Llama computes it: normalised in fp32 and rounded once, then the
    weight's product in the activations' dtype (bit for bit on a CPU, in two calls). On a GPU the
    weight goes into the same kernel (one launch, one rounding instead of two): launches, not
    arithmetic, bound a request's sparse layers there."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


@dataclass
class OffsetRMSNorm:
    """Gemma's RMSNorm: x normalised and scaled by (1 + w), all in fp32, rounded once at the end.
    `scale` holds 1 + w in fp32 (made once at load)."""

    scale: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale, eps=self.eps).to(x.dtype)


Norm = RMSNorm | OffsetRMSNorm


@dataclass
class Projections:
    """A layer's attention projections: q/k/v fused (q rows, then k, then v) and the output."""

    qkv: torch.Tensor  # [(H + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def project(self, x: torch.Tensor) -> QKV:
        return QKV(linear(x, self.qkv, self.qkv_bias), self.num_heads, self.num_kv_heads, self.head_dim)


class DecoderLayer:
    """The Llama family (Llama 2/3, SmolLM2, Qwen2, Mistral, Ministral): pre-norm attention and a
    SwiGLU MLP, each residual add fused into its output GEMM."""

    def __init__(self, input_norm: Norm, attention: Projections, post_norm: Norm, gate_up: torch.Tensor,
                 down: torch.Tensor):
        self.input_norm, self.attention, self.post_norm = input_norm, attention, post_norm
        self.gate_up, self.down = gate_up, down

    def qkv(self, hidden: torch.Tensor) -> QKV:
        return self.attention.project(self.input_norm(hidden))

    def attn_out(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        # residual add fused into the GEMM (beta=1); a new tensor, `hidden` is left as it was
        return linear(attn, self.attention.o_proj, residual=hidden)

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.post_norm(hidden), hidden)

    def ffn(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        act = silu_mul(linear(x, self.gate_up))  # on a CPU in place on the fresh gate/up buffer
        return linear(act, self.down, residual=residual)


class QKNormLayer(DecoderLayer):
    """Qwen3's layer: the Llama layer with a per-head RMSNorm of q and of k before RoPE. Both
    norms run as one over q's and k's heads together (`qk_weight` [H + Hkv, D]: q's weight on q's
    heads, k's on k's), in place in the fused projection, so the stored pre-RoPE keys are the
    normed ones and every later step reads them as any other family's."""

    def __init__(self, *args: object, qk_weight: torch.Tensor, eps: float, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.qk_weight, self.eps = qk_weight, eps

    def qkv(self, hidden: torch.Tensor) -> QKV:
        out = super().qkv(hidden)
        qk = out.qk
        qk.copy_(self.qk_weight * F.rms_norm(qk, (qk.shape[-1],), eps=self.eps))
        return out
