"""RoPE for keys stored before rotation: the torch reference (runs on CPU and as GPU fallback).

Keys in the chunk store are position-free (pre-RoPE); placing a chunk at new global positions is
one call of `apply_rope` with those positions. The maths follows the Hugging Face Llama code
(cos/sin in fp32, cast to the activation dtype before the multiply) so full prefill matches it.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_wavelen = original_max_position_embeddings / low_freq_factor
        high_wavelen = original_max_position_embeddings / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, shape [T, head_dim], fp32, for the given (arbitrary, unsorted) positions."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by per-token cos/sin [T, head_dim] (NeoX layout by default).

    For the interleaved (GPT-J) layout, cos/sin from `cos_sin` are re-ordered so that pair i uses
    frequency i, as in the original RoPE paper.
    """
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    if interleaved:
        half = cos.shape[-1] // 2
        cos = cos[..., :half].repeat_interleave(2, dim=-1)
        sin = sin[..., :half].repeat_interleave(2, dim=-1)
        return x * cos + _rotate_interleaved(x) * sin
    # NeoX: out = x * cos + rotate_half(x) * sin, written half by half (cos/sin repeat across the
    # halves): four half-size ops instead of a negation, a concatenation and three full-size ops.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, c, out=out[..., :half]).addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=out[..., half:]).addcmul_(x1, s)
    return out


def span_positions(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Target positions for chunks laid end to end in one buffer: chunk c gets starts[c] + 0..len-1.

    Lets many chunks be re-rotated in one call (one position per stored token), whatever gaps or
    order the target layout has.
    """
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    chunk_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    first_token = torch.cumsum(lengths, 0) - lengths
    offset_in_chunk = torch.arange(total, device=lengths.device) - first_token[chunk_of_token]
    return starts.to(torch.int64)[chunk_of_token] + offset_in_chunk


def rotate_keys(
    keys_pre: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    interleaved: bool = False,
    out: torch.Tensor | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reference re-rotation: pre-RoPE keys [T, heads, head_dim] placed at `positions` [T].

    Exactly `apply_rope(keys_pre, *cos_sin(positions, inv_freq))`, so it is what the engine has
    always computed; the Triton kernel is checked against this. `out` (any [T, heads, head_dim]
    view, e.g. a slice of the assembled KV buffer) receives the result when given. `tables`:
    those cos/sin already computed (a prefill rotating one layer at a time computes them once).
    """
    cos, sin = tables if tables is not None else cos_sin(positions, inv_freq)
    rotated = apply_rope(keys_pre, cos, sin, interleaved=interleaved)
    if out is None:
        return rotated
    out.copy_(rotated)
    return out
