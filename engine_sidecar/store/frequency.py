"""CacheTune's per-token frequency scores of a cached chunk. Computed when a chunk is written to
the disk tier (stored beside its KV, so a request can choose which tokens to recompute, and
therefore which rows it need not read, before loading any KV), or per request otherwise."""

from __future__ import annotations

import math

import torch

DEFAULT_CUTOFF = 0.5


def frequency_scores(keys: torch.Tensor, values: torch.Tensor, cutoff: float = 0.5) -> torch.Tensor:
    """CacheTune token scores for one cached chunk: keys/values [L, n, Hkv, D] -> [n].

    Per layer, K and V are low-pass filtered along the sequence (rFFT, keep the lowest `cutoff`
    share of frequencies, inverse rFFT); a token's score is the L2 norm of its low-frequency
    reconstruction, the mean of the K and V scores, averaged over layers. Tokens carrying the
    chunk's slowly varying content score high; they are the ones recomputed."""
    n = keys.shape[1]

    def low_pass_norm(x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x.float(), dim=1)
        keep = max(1, math.ceil(cutoff * spectrum.shape[1]))
        spectrum[:, keep:] = 0
        return torch.fft.irfft(spectrum, n=n, dim=1).flatten(2).norm(dim=2)  # [L, n]

    return ((low_pass_norm(keys) + low_pass_norm(values)) / 2).mean(dim=0)
