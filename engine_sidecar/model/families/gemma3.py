"""Gemma 3 (text): five sliding-window layers per global one, each kind with its own RoPE (10k
locally, 1M with its scaling globally), per-head q/k norms, four RMSNorms per layer scaling by
(1 + w) (around attention and around the MLP: "sandwich" norms), a GeGLU MLP with tanh GELU,
embeddings scaled by sqrt(hidden) and tied to the output, and queries scaled by
`query_pre_attn_scalar` rather than head_dim (folded into q's norm at load)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from engine_sidecar.model.config import ModelConfig, RopeConfig, rope_from, rope_params
from engine_sidecar.model.families.base import SLIDING, Family
from engine_sidecar.model.layers import QKV, DecoderLayer, Norm, OffsetRMSNorm, Projections
from engine_sidecar.model.weights import ModelWeights, Tensors
from ragcache_kernels.dispatch import linear


class GemmaLayer(DecoderLayer):
    def __init__(self, input_norm: Norm, attention: Projections, post_attn_norm: Norm, pre_ffn_norm: Norm,
                 post_ffn_norm: Norm, gate_up: torch.Tensor, down: torch.Tensor, qk_scale: torch.Tensor, eps: float):
        super().__init__(input_norm, attention, pre_ffn_norm, gate_up, down)
        self.post_attn_norm, self.post_ffn_norm = post_attn_norm, post_ffn_norm
        self.qk_scale, self.eps = qk_scale, eps  # [H + Hkv, D] fp32: (1 + w) per head, q's times the query scale

    def qkv(self, hidden: torch.Tensor) -> QKV:
        out = super().qkv(hidden)
        qk = out.qk
        qk.copy_(F.rms_norm(qk.float(), (qk.shape[-1],), eps=self.eps).mul_(self.qk_scale).to(qk.dtype))
        return out

    def attn_out(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return hidden + self.post_attn_norm(linear(attn, self.attention.o_proj))

    def ffn(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        out = self.post_ffn_norm(linear(F.gelu(gate, approximate="tanh") * up, self.down))
        return out if residual is None else residual + out


class Gemma3(Family):
    model_types = ("gemma3_text",)
    has_qk_norm = True

    def ropes(self, raw: dict[str, Any], head_dim: int,
              num_layers: int) -> tuple[tuple[RopeConfig, ...], tuple[int, ...]]:
        global_rope = rope_from(rope_params(raw, "full_attention"), head_dim)
        nested = raw.get("rope_parameters") or {}
        if isinstance(nested.get(SLIDING), dict):
            local = rope_from(dict(nested[SLIDING]), head_dim)
        else:  # configs before transformers 5: a base of its own, never scaled
            local = RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))
        types = raw.get("layer_types") or sliding_pattern(raw, num_layers)
        return (global_rope, local), tuple(1 if t == SLIDING else 0 for t in types)

    def layer_windows(self, raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        window = raw.get("sliding_window")
        types = raw.get("layer_types") or sliding_pattern(raw, num_layers)
        return tuple(int(window) if t == SLIDING and window else None for t in types)

    def extra(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        from engine_sidecar.errors import UnsupportedModelError

        if raw.get("attn_logit_softcapping"):
            raise UnsupportedModelError("Gemma with attention logit soft-capping (Gemma 2) is not supported")
        scalar = float(raw.get("query_pre_attn_scalar") or head_dim)
        return {"query_scale": math.sqrt(head_dim / scalar), "logit_softcap": raw.get("final_logit_softcapping")}

    def norm(self, tensors: Tensors, name: str, config: ModelConfig) -> Norm:
        return OffsetRMSNorm(1.0 + tensors.take(name, dtype=torch.float32), config.rms_norm_eps)

    def layer(self, tensors: Tensors, config: ModelConfig, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        norm = self.norm
        input_norm = norm(tensors, p + "input_layernorm.weight", config)
        attention = self.projections(tensors, config, i)
        q = 1.0 + tensors.take(p + "self_attn.q_norm.weight", dtype=torch.float32)
        k = 1.0 + tensors.take(p + "self_attn.k_norm.weight", dtype=torch.float32)
        # the attention kernels scale by head_dim^-1/2: q carries the rest of query_pre_attn_scalar's
        qk_scale = torch.cat([(q * config.extra["query_scale"]).expand(config.num_heads, -1),
                              k.expand(config.num_kv_heads, -1)]).contiguous()
        gate_up, down = self.gate_up(tensors, i)
        return GemmaLayer(input_norm, attention, norm(tensors, p + "post_attention_layernorm.weight", config),
                          norm(tensors, p + "pre_feedforward_layernorm.weight", config),
                          norm(tensors, p + "post_feedforward_layernorm.weight", config), gate_up, down, qk_scale,
                          config.rms_norm_eps)

    def finish(self, weights: ModelWeights, config: ModelConfig, tensors: Tensors) -> None:
        weights.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=tensors.dtype, device=tensors.device)
        cap = config.extra.get("logit_softcap")
        weights.logit_softcap = float(cap) if cap else None


def sliding_pattern(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Gemma 3's layer kinds where the config does not list them: every `sliding_window_pattern`-th
    layer global, the others sliding."""
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    return ["full_attention" if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
