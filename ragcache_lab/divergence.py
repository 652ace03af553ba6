"""Diagnostics for `ragcache bench fidelity`: where a policy's prefill leaves full prefill's
path, layer by layer. The hidden states compared are those `capture_last_hidden`
(engine_sidecar/calibrate/reference.py) reads during the policy's prefill and full prefill's.
"""

from __future__ import annotations

import torch


def layer_divergence(hidden: torch.Tensor, reference: torch.Tensor) -> dict[str, list[float]]:
    """Per layer: cosine distance (1 - cos) and relative L2 (|h - ref| / |ref|) of [L, H] hidden
    states against the reference's."""
    cosine = torch.nn.functional.cosine_similarity(hidden, reference, dim=-1)
    rel = (hidden - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-12)
    return {"cosine_distance": [round(max(0.0, float(1.0 - c)), 7) for c in cosine],
            "relative_l2": [round(float(r), 7) for r in rel]}
