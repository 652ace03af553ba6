"""Routed experts (Qwen3-MoE): a token's MLP is the sum of its top-k experts' SwiGLU outputs,
weighted by the router's softmax over all experts (renormalised over the chosen k where the model
says so). Experts run one after another, each over the rows routed to it: a recomputed token costs
its k experts, not all of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_sidecar.model.config import MoeConfig
from engine_sidecar.model.layers import QKNormLayer
from engine_sidecar.model.weights import Tensors
from ragcache_kernels.dispatch import linear, silu_mul


@dataclass
class Experts:
    router: torch.Tensor  # [E, hidden]
    gate_up: list[torch.Tensor]  # per expert [2 * I, hidden]: gate rows, then up
    down: list[torch.Tensor]  # per expert [hidden, I]
    top_k: int
    normalize: bool

    @classmethod
    def load(cls, tensors: Tensors, prefix: str, config: MoeConfig) -> Experts:
        """Per-expert tensors (`experts.N.gate_proj`, as checkpoints hold them) or transformers'
        stacked ones (`experts.gate_up_proj` [E, 2I, hidden], `experts.down_proj` [E, hidden, I])."""
        router = tensors.take(prefix + "gate.weight")
        e = prefix + "experts."
        if tensors.has(e + "gate_up_proj"):
            stacked, downs = tensors.take(e + "gate_up_proj"), tensors.take(e + "down_proj")
            gate_up = [stacked[i].contiguous() for i in range(config.num_experts)]
            down = [downs[i].contiguous() for i in range(config.num_experts)]
        else:
            gate_up, down = [], []
            for i in range(config.num_experts):
                fused = tensors.fused(f"{e}{i}.gate_proj.weight", f"{e}{i}.up_proj.weight")
                assert fused is not None
                gate_up.append(fused)
                down.append(tensors.take(f"{e}{i}.down_proj.weight"))
        return cls(router, gate_up, down, config.experts_per_token, config.normalize_top_k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for rows x [T, hidden] -> [T, hidden]."""
        probs = torch.softmax(linear(x, self.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # which experts any row chose decides the work: one read-back per layer (MoE layers are not
        # captured in graphs for this reason)
        for expert in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == expert)
            y = linear(silu_mul(linear(x[rows], self.gate_up[expert])), self.down[expert])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class MoeLayer(QKNormLayer):
    """Qwen3-MoE's sparse layer: Qwen3's attention, routed experts for the MLP."""

    def __init__(self, input_norm: object, attention: object, post_norm: object, *, experts: Experts,
                 qk_weight: torch.Tensor, eps: float):
        super().__init__(input_norm, attention, post_norm, None, None, qk_weight=qk_weight, eps=eps)
        self.experts = experts

    def ffn(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        out = self.experts(x)
        return out if residual is None else residual + out
