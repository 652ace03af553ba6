"""A compact Llama-family forward (Llama/SmolLM2, Qwen2, Mistral) exposed as per-layer steps.

The fused-prefill executor drives these steps itself: it decides, per layer, which tokens get
hidden states, which cached keys are rotated where, and which mask applies. Shapes are
per-sequence (no batch axis): hidden [T, hidden], q [T, H, D], k/v [T, Hkv, D].
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_sidecar.errors import UnsupportedDtypeError
from engine_sidecar.model.config import ModelConfig, load_config
from engine_sidecar.model.weights import LayerWeights, ModelWeights, load_weights
from ragcache_kernels import cpu_native
from ragcache_kernels.dispatch import apply_rope, linear, rotate_keys, selective_attention, silu_mul
from ragcache_kernels.rope import cos_sin, inv_frequencies

log = logging.getLogger("ragcache.model")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise UnsupportedDtypeError(f"unknown device '{device}': use auto, cpu or cuda") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedDtypeError("device 'cuda' requested but no CUDA GPU is visible: use --device cpu")
    return resolved


def cpu_bf16_native(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU computes bf16 natively (AVX512-bf16 or AMX); None where unknown."""
    try:
        flags = set(cpuinfo.read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # fp32 on CPU. On CPUs with AVX512-bf16/AMX bf16 prefill is faster and full prefill's
        # answers match fp32's closely, but fused answers lose a little more; on AVX2-only CPUs
        # bf16 is emulated and much slower (docs/benchmarks.md, "Prefill speed").
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UnsupportedDtypeError(f"unknown dtype '{dtype}': use auto, float32, bfloat16 or float16")
    resolved = DTYPES[dtype]
    if resolved == torch.float16 and device.type == "cpu":
        raise UnsupportedDtypeError("float16 is not supported on CPU: use --dtype bfloat16 or float32")
    if resolved == torch.bfloat16 and device.type == "cpu" and cpu_bf16_native() is False:
        log.warning("bfloat16 on a CPU without AVX512-bf16 or AMX is emulated: prefill is several times "
                    "slower than float32 here (measured ~6x on an AVX2 EPYC); use --dtype float32")
    return resolved


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

    def take(self, rows: torch.Tensor) -> QKV:
        """These rows (indices) of q, k and v, in one gather."""
        return QKV(self.joint[rows], self.num_heads, self.num_kv_heads, self.head_dim)

    def rotated(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [A, H, D] and k [A, Hkv, D] rotated by per-row tables [A, D], in one call (cos/sin
        already in the activations' dtype spare the call its two conversions). With the rows'
        `positions` and the model's `inv_freq`, a GPU rotates them in one Triton launch instead
        (cos/sin computed in fp32 in registers). Views, rows not contiguous."""
        heads = self.num_heads + self.num_kv_heads
        qk = self.joint[:, : heads * self.head_dim].unflatten(-1, (heads, self.head_dim))
        if positions is not None and inv_freq is not None:
            out = rotate_keys(qk, positions, inv_freq, tables=(cos, sin))
        else:
            out = apply_rope(qk, cos, sin)
        return out[:, : self.num_heads], out[:, self.num_heads :]


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: ModelWeights, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.device = device
        rope = config.rope
        self.inv_freq = inv_frequencies(
            config.head_dim, rope.theta, rope.rope_type, rope.factor, rope.low_freq_factor,
            rope.high_freq_factor, rope.original_max_position_embeddings,
        ).to(device)

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "auto", dtype: str = "auto") -> ModelRunner:
        path = Path(model_dir)
        config = load_config(path)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        if dev.type == "cpu":
            cpu_native.library(dt)  # built now (seconds, once per CPU), not on the first request's clock
        return cls(config, load_weights(path, config, dt, dev), dt, dev)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    # --- steps -------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids.to(self.device), self.weights.embed)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm normalises half-precision input in fp32 and rounds once, then the weight's
        # product in the activations' dtype: transformers' arithmetic (bit for bit on a CPU) in two
        # calls instead of eight. On a GPU the weight goes into the same kernel (one launch, one
        # rounding instead of two): launches, not arithmetic, bound a request's sparse layers there
        if x.device.type == "cuda":
            return F.rms_norm(x, (x.shape[-1],), weight, eps=self.config.rms_norm_eps)
        return weight * F.rms_norm(x, (x.shape[-1],), eps=self.config.rms_norm_eps)

    def qkv(self, layer: int, hidden: torch.Tensor) -> QKV:
        """Input norm and q/k/v projections; k is returned before RoPE (position-free).

        One matmul over the fused q/k/v weight; q, k and v are views into its output (rows are
        not contiguous, the last two axes are)."""
        w = self.weights.layers[layer]
        x = self.rms_norm(hidden, w.input_norm)
        c = self.config
        return QKV(linear(x, w.qkv_proj, w.qkv_bias), c.num_heads, c.num_kv_heads, c.head_dim)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin(positions.to(self.device), self.inv_freq)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_tables(positions)
        return apply_rope(x, cos, sin)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        query_pos: torch.Tensor,
        key_pos: torch.Tensor,
        dense_causal: bool = False,
    ) -> torch.Tensor:
        out = selective_attention(q, k, v, query_pos, key_pos, self.config.sliding_window, dense_causal)
        return out.reshape(out.shape[0], -1)

    def attn_out(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        # residual add fused into the GEMM (beta=1); a new tensor, `hidden` is left as it was
        return linear(attn, self.weights.layers[layer].o_proj, residual=hidden)

    def mlp(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        w: LayerWeights = self.weights.layers[layer]
        x = self.rms_norm(hidden, w.post_norm)
        act = silu_mul(linear(x, w.gate_up_proj))  # on a CPU in place on the fresh gate/up buffer
        return linear(act, w.down_proj, residual=hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(self.rms_norm(hidden, self.weights.final_norm), self.weights.lm_head).float()

    # --- convenience -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Plain full prefill of one sequence at positions 0..T-1 -> logits [T, vocab]."""
        positions = torch.arange(token_ids.shape[0], device=self.device)
        h = self.embed(token_ids)
        cos, sin = (t.to(self.dtype) for t in self.rope_tables(positions))
        for layer in range(self.num_layers):
            s = self.qkv(layer, h)
            q, k = s.rotated(cos, sin)
            a = self.attention(q, k, s.v, positions, positions, dense_causal=True)
            h = self.mlp(layer, self.attn_out(layer, h, a))
        return self.logits(h)
