"""Phi-3 and Phi-4-mini: the Llama layer with q/k/v and gate/up stored fused, RoPE on a share of
each head (`partial_rotary_factor`) and LongRoPE.

Partial rotary runs on the same kernels as full: at load, q's and k's head dimensions are laid out
so that the rotated pairs come first in each half and the others get frequency 0 (cos 1, sin 0);
the same permutation on q and k leaves every q.k product as it was. LongRoPE's constant scale of
the rotated dimensions goes into those rows of the q and k weights. Its frequencies switch from
the short to the long factors once a sequence passes `original_max_position_embeddings`, which
would change the rotation of every key already stored: the engine serves such a model up to that
length (short factors) and refuses longer prompts with a clear message."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine_sidecar.model.config import ModelConfig, RopeConfig, rope_from, rope_params
from engine_sidecar.model.families.base import Family
from engine_sidecar.model.layers import Projections
from engine_sidecar.model.weights import ModelWeights, Tensors, check_q_shape


def rotary_layout(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """New head dimension -> old: [rotated first half, passed first half, rotated second half,
    passed second half], so NeoX's pair (j, j + D/2) is a rotated pair for j < rotary_dim / 2."""
    half_r, half_p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    old = list(range(half_r)) + list(range(rotary_dim, rotary_dim + half_p)) + \
        list(range(half_r, rotary_dim)) + list(range(rotary_dim + half_p, head_dim))
    return torch.tensor(old)


class Phi3(Family):
    model_types = ("phi3",)

    def rotary_dim(self, raw: dict[str, Any], head_dim: int) -> int:
        factor = float(rope_params(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        rotary = int(head_dim * factor)
        if rotary % 2 or (head_dim - rotary) % 2:
            raise ValueError(f"partial rotary of {rotary} of {head_dim} dimensions does not split in pairs")
        return rotary

    def ropes(self, raw: dict[str, Any], head_dim: int,
              num_layers: int) -> tuple[tuple[RopeConfig, ...], tuple[int, ...]]:
        params = rope_params(raw)
        rope = rope_from(params, head_dim)
        if rope.rope_type == "longrope":
            original = rope.original_max_position_embeddings
            factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
            attention = params.get("attention_factor")
            if attention is None:
                attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            rope = RopeConfig(theta=rope.theta, rope_type="longrope", factor=float(factor),
                              original_max_position_embeddings=original, ext_factors=rope.ext_factors,
                              attention_factor=float(attention))
        return (rope,), (0,) * num_layers

    def max_positions(self, raw: dict[str, Any]) -> int:
        longest = int(raw.get("max_position_embeddings", 4096))
        params = rope_params(raw)
        if str(params.get("rope_type", params.get("type", ""))) == "longrope":
            return min(longest, int(params.get("original_max_position_embeddings") or longest))
        return longest

    def projections(self, tensors: Tensors, config: ModelConfig, i: int) -> Projections:
        p = f"model.layers.{i}.self_attn."
        qkv = tensors.raw(p + "qkv_proj.weight").clone()
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        if config.rotary_dim != config.head_dim or config.rope.attention_factor != 1.0:
            layout = rotary_layout(config.head_dim, config.rotary_dim)
            rotated = torch.zeros(config.head_dim, dtype=torch.bool)
            half, half_r = config.head_dim // 2, config.rotary_dim // 2
            rotated[:half_r] = rotated[half : half + half_r] = True
            for start, heads in ((0, config.num_heads), (q_rows, config.num_kv_heads)):
                block = qkv[start : start + heads * config.head_dim].unflatten(0, (heads, config.head_dim))
                block = block[:, layout].float()
                block[:, rotated] *= config.rope.attention_factor
                qkv[start : start + heads * config.head_dim] = block.flatten(0, 1).to(qkv.dtype)
        assert qkv.shape[0] == q_rows + 2 * kv_rows
        return Projections(tensors.place(qkv), None, tensors.take(p + "o_proj.weight"), config.num_heads,
                           config.num_kv_heads, config.head_dim)

    def gate_up(self, tensors: Tensors, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = f"model.layers.{i}.mlp."
        return tensors.take(m + "gate_up_proj.weight"), tensors.take(m + "down_proj.weight")

    def load(self, tensors: Tensors, config: ModelConfig) -> ModelWeights:
        check_q_shape(tensors, "model.layers.0.self_attn.qkv_proj.weight",
                      ((config.num_heads + 2 * config.num_kv_heads) * config.head_dim, config.hidden_size))
        return super().load(tensors, config)
