"""What a family is: how it reads its `config.json` and builds its layers from a folder's tensors.
The Llama family's reading is the default; the others change what differs."""

from __future__ import annotations

from typing import Any

import torch

from engine_sidecar.model.config import ModelConfig, RopeConfig, eos_ids, rope_from, rope_params
from engine_sidecar.model.layers import DecoderLayer, Norm, Projections, RMSNorm
from engine_sidecar.model.weights import ModelWeights, Tensors, check_q_shape

SLIDING = "sliding_attention"


class Family:
    """The Llama family's config and layers; subclasses override what their architecture changes."""

    model_types: tuple[str, ...] = ()

    # --- config.json -------------------------------------------------------------------------
    def read_config(self, raw: dict[str, Any]) -> ModelConfig:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_layers = int(raw["num_hidden_layers"])
        windows = self.layer_windows(raw, num_layers)
        ropes, layer_ropes = self.ropes(raw, head_dim, num_layers)
        window = next((w for w in windows if w is not None), None)
        return ModelConfig(
            model_type=str(raw["model_type"]),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=ropes[0],
            max_position_embeddings=self.max_positions(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=self.qkv_bias(raw),
            sliding_window=window,
            eos_token_ids=eos_ids(raw),
            bos_token_id=raw.get("bos_token_id"),
            layer_windows=windows,
            layer_ropes=layer_ropes,
            ropes=ropes,
            rotary_dim=self.rotary_dim(raw, head_dim),
            qk_norm=self.has_qk_norm,
            moe=self.moe(raw, num_layers),
            extra=self.extra(raw, head_dim),
        )

    has_qk_norm = False

    def max_positions(self, raw: dict[str, Any]) -> int:
        return int(raw.get("max_position_embeddings", 4096))

    def qkv_bias(self, raw: dict[str, Any]) -> bool:
        # Llama may declare q/k/v (and o) biases with attention_bias
        return bool(raw.get("attention_bias", False))

    def layer_windows(self, raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        """Each layer's window: where `layer_types` names them, its sliding layers have the
        config's window and the rest none."""
        window = raw.get("sliding_window")
        types = raw.get("layer_types")
        if types:
            if len(types) != num_layers:
                raise ValueError(f"layer_types names {len(types)} layers, the model has {num_layers}")
            return tuple(int(window) if t == SLIDING and window else None for t in types)
        return (int(window) if window else None,) * num_layers

    def ropes(self, raw: dict[str, Any], head_dim: int,
              num_layers: int) -> tuple[tuple[RopeConfig, ...], tuple[int, ...]]:
        return (rope_from(rope_params(raw), head_dim),), (0,) * num_layers

    def rotary_dim(self, raw: dict[str, Any], head_dim: int) -> int:
        return head_dim

    def moe(self, raw: dict[str, Any], num_layers: int) -> Any:
        return None

    def extra(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        return {}

    # --- weights -----------------------------------------------------------------------------
    def load(self, tensors: Tensors, config: ModelConfig) -> ModelWeights:
        check_q_shape(tensors, "model.layers.0.self_attn.q_proj.weight",
                      (config.num_heads * config.head_dim, config.hidden_size))
        layers = [self.layer(tensors, config, i) for i in range(config.num_layers)]
        embed = tensors.take("model.embed_tokens.weight")
        lm_head = tensors.take_optional("lm_head.weight")
        if lm_head is None:
            if not config.tie_word_embeddings:
                tensors.raw("lm_head.weight")  # the one-line "missing" error
            lm_head = embed
        final_norm = self.norm(tensors, "model.norm.weight", config)
        weights = ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
        self.finish(weights, config, tensors)
        return weights

    def finish(self, weights: ModelWeights, config: ModelConfig, tensors: Tensors) -> None:
        """Model-wide extras (an embedding scale, a logit cap)."""

    def norm(self, tensors: Tensors, name: str, config: ModelConfig) -> Norm:
        return RMSNorm(tensors.take(name), config.rms_norm_eps)

    def projections(self, tensors: Tensors, config: ModelConfig, i: int) -> Projections:
        p = f"model.layers.{i}.self_attn."
        qkv = tensors.fused(p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight")
        bias = tensors.fused(p + "q_proj.bias", p + "k_proj.bias", p + "v_proj.bias", optional=not config.qkv_bias)
        assert qkv is not None
        return Projections(qkv, bias, tensors.take(p + "o_proj.weight"), config.num_heads, config.num_kv_heads,
                           config.head_dim)

    def gate_up(self, tensors: Tensors, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = f"model.layers.{i}.mlp."
        fused = tensors.fused(m + "gate_proj.weight", m + "up_proj.weight")
        assert fused is not None
        return fused, tensors.take(m + "down_proj.weight")

    def layer(self, tensors: Tensors, config: ModelConfig, i: int) -> DecoderLayer:
        prefix = f"model.layers.{i}."
        input_norm = self.norm(tensors, prefix + "input_layernorm.weight", config)
        attention = self.projections(tensors, config, i)
        post_norm = self.norm(tensors, prefix + "post_attention_layernorm.weight", config)
        gate_up, down = self.gate_up(tensors, i)
        return DecoderLayer(input_norm, attention, post_norm, gate_up, down)
