"""A compact forward for every supported family, exposed as per-layer steps.

The fused-prefill executor drives these steps itself: it decides, per layer, which tokens get
hidden states, which cached keys are rotated where, and which mask applies. What a layer computes
is its family's (`model/layers.py`, `model/families/`); the runner adds each layer's RoPE table
and attention window. Shapes are per-sequence (no batch axis): hidden [T, hidden], q [T, H, D],
k/v [T, Hkv, D].
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_sidecar.errors import UnsupportedDtypeError
from engine_sidecar.model.config import ModelConfig
from engine_sidecar.model.families import load_config, load_weights
from engine_sidecar.model.layers import QKV, DecoderLayer, RMSNorm
from engine_sidecar.model.rope import RopeTables, model_inv_freqs
from engine_sidecar.model.weights import ModelWeights
from ragcache_kernels import cpu_native
from ragcache_kernels.dispatch import apply_rope, linear, selective_attention

__all__ = ["QKV", "ModelRunner", "RopeTables", "resolve_device", "resolve_dtype"]

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


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: ModelWeights, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.device = device
        # one per RoPE table the model uses (most: one); layer i rotates by inv_freqs[layer_ropes[i]]
        self.inv_freqs = tuple(inv.to(device) for inv in model_inv_freqs(config))
        self.layer_windows = config.layer_windows

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

    @property
    def layers(self) -> list[DecoderLayer]:
        """Each layer's own computation (its family's class): every path calls these."""
        return self.weights.layers

    @property
    def inv_freq(self) -> torch.Tensor:
        """The first layer's inverse frequencies (every layer's, in a model with one RoPE table)."""
        return self.inv_freq_at(0)

    def inv_freq_at(self, layer: int) -> torch.Tensor:
        return self.inv_freqs[self.config.layer_ropes[layer]]

    def window(self, layer: int) -> int | None:
        """How many keys back this layer's queries see (None: all earlier keys)."""
        return self.layer_windows[layer]

    # --- steps -------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(token_ids.to(self.device), self.weights.embed)
        return out if self.weights.embed_scale is None else out * self.weights.embed_scale

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The Llama family's RMSNorm of x by `weight` (`layers.RMSNorm`)."""
        return RMSNorm(weight, self.config.rms_norm_eps)(x)

    def qkv(self, layer: int, hidden: torch.Tensor) -> QKV:
        """Input norm and q/k/v projections; k is returned before RoPE (position-free), after any
        q/k norm. One matmul over the fused q/k/v weight; q, k and v are views into its output."""
        return self.weights.layers[layer].qkv(hidden)

    def rope_tables(self, positions: torch.Tensor) -> RopeTables:
        """cos/sin at these positions for every RoPE table; `.at(layer)` is a layer's pair."""
        return RopeTables.of(positions.to(self.device), self.inv_freqs, self.config.layer_ropes)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, layer: int = 0) -> torch.Tensor:
        cos, sin = self.rope_tables(positions).at(layer)
        return apply_rope(x, cos, sin)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        query_pos: torch.Tensor,
        key_pos: torch.Tensor,
        dense_causal: bool = False,
        layer: int = 0,
    ) -> torch.Tensor:
        out = selective_attention(q, k, v, query_pos, key_pos, self.window(layer), dense_causal)
        return out.reshape(out.shape[0], -1)

    def attn_out(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection and residual; a new tensor, `hidden` is left as it was."""
        return self.weights.layers[layer].attn_out(hidden, attn)

    def mlp(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.weights.layers[layer].mlp(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = linear(self.weights.final_norm(hidden), self.weights.lm_head).float()
        cap = self.weights.logit_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    # --- convenience -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Plain full prefill of one sequence at positions 0..T-1 -> logits [T, vocab]."""
        positions = torch.arange(token_ids.shape[0], device=self.device)
        h = self.embed(token_ids)
        tables = self.rope_tables(positions).to(self.dtype)
        for layer in range(self.num_layers):
            s = self.qkv(layer, h)
            q, k = s.rotated(*tables.at(layer))
            a = self.attention(q, k, s.v, positions, positions, dense_causal=True, layer=layer)
            h = self.mlp(layer, self.attn_out(layer, h, a))
        return self.logits(h)
