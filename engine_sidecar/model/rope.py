"""Each layer's RoPE: the inverse frequencies of every RoPE table a model uses (Gemma 3 has two:
local layers and global ones) and the cos/sin tables of one set of positions, per table."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_sidecar.model.config import ModelConfig, RopeConfig
from ragcache_kernels.rope import cos_sin, inv_frequencies


def rope_inv_freq(rope: RopeConfig, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies. With partial rotary (rotary_dim < head_dim) the family
    lays q's and k's head dimensions out so that the rotated pairs come first in each half: the
    frequencies of the others are 0 (cos 1, sin 0), which every RoPE kernel leaves as they are."""
    if rope.rope_type == "longrope" and rope.ext_factors is not None:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv = 1.0 / (torch.tensor(rope.ext_factors, dtype=torch.float32) * rope.theta**exponents)
    else:
        inv = inv_frequencies(rotary_dim, rope.theta, rope.rope_type, rope.factor, rope.low_freq_factor,
                              rope.high_freq_factor, rope.original_max_position_embeddings)
    if rotary_dim == head_dim:
        return inv
    return torch.cat([inv, torch.zeros(head_dim // 2 - inv.shape[0])])


def model_inv_freqs(config: ModelConfig) -> tuple[torch.Tensor, ...]:
    return tuple(rope_inv_freq(r, config.head_dim, config.rotary_dim) for r in config.ropes)


@dataclass(frozen=True)
class RopeTables:
    """cos/sin [T, head_dim] of the same positions for each RoPE table of the model; a layer reads
    the table it rotates by (`at`). A model with one table (most) holds one pair."""

    per_rope: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    layer_ropes: tuple[int, ...]

    @classmethod
    def of(cls, positions: torch.Tensor, inv_freqs: tuple[torch.Tensor, ...],
           layer_ropes: tuple[int, ...]) -> RopeTables:
        return cls(tuple(cos_sin(positions, inv) for inv in inv_freqs), layer_ropes)

    def at(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.per_rope[self.layer_ropes[layer]]

    def take(self, rows: torch.Tensor) -> RopeTables:
        return RopeTables(tuple((c[rows], s[rows]) for c, s in self.per_rope), self.layer_ropes)

    def to(self, dtype: torch.dtype) -> RopeTables:
        return RopeTables(tuple((c.to(dtype), s.to(dtype)) for c, s in self.per_rope), self.layer_ropes)
