"""Qwen3 dense and Qwen3-MoE: the Llama layer with a per-head RMSNorm of q and k before RoPE (the
chunk store keeps keys after the norm, before RoPE); Qwen3-MoE routes each token's MLP to its top-k
experts (`moe.MoeLayer`)."""

from __future__ import annotations

from typing import Any

import torch

from engine_sidecar.model.config import ModelConfig, MoeConfig
from engine_sidecar.model.families.base import Family
from engine_sidecar.model.families.llama import qwen_windows
from engine_sidecar.model.layers import DecoderLayer, QKNormLayer
from engine_sidecar.model.moe import Experts, MoeLayer
from engine_sidecar.model.weights import Tensors


def qk_norm_weight(tensors: Tensors, config: ModelConfig, i: int) -> torch.Tensor:
    """q's norm weight on each of q's heads and k's on each of k's: [H + Hkv, D], one norm for both."""
    p = f"model.layers.{i}.self_attn."
    q, k = tensors.take(p + "q_norm.weight"), tensors.take(p + "k_norm.weight")
    return torch.cat([q.expand(config.num_heads, -1), k.expand(config.num_kv_heads, -1)]).contiguous()


class Qwen3(Family):
    model_types = ("qwen3",)
    has_qk_norm = True

    def layer_windows(self, raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        return qwen_windows(raw, num_layers)

    def layer(self, tensors: Tensors, config: ModelConfig, i: int) -> DecoderLayer:
        base = super().layer(tensors, config, i)
        return QKNormLayer(base.input_norm, base.attention, base.post_norm, base.gate_up, base.down,
                           qk_weight=qk_norm_weight(tensors, config, i), eps=config.rms_norm_eps)


class Qwen3Moe(Qwen3):
    model_types = ("qwen3_moe",)

    def moe(self, raw: dict[str, Any], num_layers: int) -> MoeConfig:
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        only_mlp = set(raw.get("mlp_only_layers") or [])
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        dense = tuple(i for i in range(num_layers) if i in only_mlp or experts == 0 or (i + 1) % step != 0)
        return MoeConfig(num_experts=experts, experts_per_token=int(raw["num_experts_per_tok"]),
                         expert_size=int(raw["moe_intermediate_size"]),
                         normalize_top_k=bool(raw.get("norm_topk_prob", False)), dense_layers=dense)

    def layer(self, tensors: Tensors, config: ModelConfig, i: int) -> DecoderLayer:
        assert config.moe is not None
        if i in config.moe.dense_layers:
            return super().layer(tensors, config, i)
        prefix = f"model.layers.{i}."
        input_norm = self.norm(tensors, prefix + "input_layernorm.weight", config)
        attention = self.projections(tensors, config, i)
        post_norm = self.norm(tensors, prefix + "post_attention_layernorm.weight", config)
        experts = Experts.load(tensors, prefix + "mlp.", config.moe)
        return MoeLayer(input_norm, attention, post_norm, experts=experts,
                        qk_weight=qk_norm_weight(tensors, config, i), eps=config.rms_norm_eps)
