"""`tempT` (attention temperature) on a fused prefill: which fused chunks' cached keys are scaled
by 1/T, and the per-layer scaling of those rows where keys are rotated as they arrive from disk."""

from __future__ import annotations

import torch

from engine_sidecar.execution.policies import Policy
from engine_sidecar.store.entry import ChunkKV, warmed_after_neighbours


def is_tempered(cached: ChunkKV | None, policy: Policy) -> bool:
    """Whether `tempT` scales this fused chunk's keys: always under a spec's own tempT; under the
    model's calibrated T not KV warmed after neighbours."""
    return policy.temperature != 1.0 and (policy.temper_neighbour_kv or cached is None
                                          or not warmed_after_neighbours(cached))


def temper_stale_rows(keys: torch.Tensor, fused: torch.Tensor, active: torch.Tensor, scale: float | None) -> None:
    """Scale in place the rows of `keys` [n, Hkv, D] that hold fused chunks' cached KV on this
    layer (fused, not recomputed here): `tempT` under layer-wise loading, where each layer's keys
    are rotated as they arrive."""
    if scale is None:
        return
    # a per-row factor (1 where nothing is scaled, which is exact) rather than boolean indexing,
    # whose size the host would have to read back on every layer
    factor = torch.where(fused, scale, 1.0).to(device=keys.device)  # fp32: the scalar product, rounded once
    factor[active] = 1.0
    keys.mul_(factor[:, None, None])
