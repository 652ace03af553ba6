"""Cache-Craft (Agarwal et al., SIGMOD'25): chunk caches computed inside real requests, kept as
variants with metadata that says how much a variant must be fixed when reused elsewhere.

When a chunk C_i is computed in a request after prior chunks C_1..C_{i-1}, per layer l:
    a_l = sum_j inter(C_i, C_j) / (|C_i| |C_j|)     attention mass from C_i's tokens to each prior chunk
    b_l = intra(C_i) / |C_i|^2                       causal attention mass inside C_i
averaged over layers (a, b), giving the Cache Context Impact CCI = 1 / (1 + exp(-a / b)): how
much the chunk's KV depends on the context it was computed in. Per token, the inter-attention
(mass to prior chunks, averaged over layers and heads) ranks which tokens to recompute.

Reusing a variant in a new request whose prior chunks are P_now (the variant's were P_then):
    beta  = |P_then & P_now| / |P_then|              prefix overlap
    gamma = normalized Kendall tau distance of the shared chunks' order
    beta' = beta (1 - gamma)
    CFO   = alpha * CCI * (1 - beta')                share of the chunk's tokens to recompute
and the top ceil(CFO |C|) tokens by inter-attention are recomputed. A chunk keeps up to M
variants (N*M in all); the lowest-CFO variant is used, its frequency-reuse score f_r grows by
1/CFO on each use, and the lowest f_r is evicted first.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine_sidecar.store.entry import CacheKey

Span = tuple[int, int]  # [start, end) global token positions


# --- formulas ---------------------------------------------------------------------------------
def layer_scores(probs: torch.Tensor, chunk: Span, prior: Sequence[Span]) -> tuple[float, float, torch.Tensor]:
    """One layer's (a_l, b_l, per-token inter-attention) for a chunk.

    `probs` [|C_i|, >= chunk end]: head-averaged attention rows of the chunk's tokens over key
    positions 0.. (causal, rows sum to 1)."""
    start, end = chunk
    n = end - start
    inter_tokens = torch.zeros(n, dtype=torch.float32)
    a = 0.0
    for s, e in prior:
        block = probs[:, s:e].float()
        inter_tokens += block.sum(dim=1)
        a += float(block.sum()) / (n * (e - s))
    b = float(torch.tril(probs[:, start:end].float()).sum()) / (n * n)
    return a, b, inter_tokens


def cache_context_impact(a_mean: float, b_mean: float, eps: float = 1e-12) -> float:
    """CCI = sigmoid(a / b); a chunk that attends nowhere but outside itself scores 1."""
    if b_mean <= eps:
        return 1.0
    return 1.0 / (1.0 + math.exp(-a_mean / b_mean))


def prefix_overlap(then: Sequence[str], now: Sequence[str]) -> float:
    """beta: share of the chunks the variant was computed after that precede it again now. A
    variant computed with no prior chunks fits a request with none exactly (1), else not at all (0)."""
    if not then:
        return 1.0 if not now else 0.0
    return len(set(then) & set(now)) / len(set(then))


def kendall_tau_distance(first: Sequence[str], second: Sequence[str]) -> float:
    """Normalized Kendall tau distance over the items both orders share: the share of their pairs
    in opposite order (0 = same order, 1 = reversed; 0 when fewer than two are shared)."""
    rank = {item: i for i, item in enumerate(second)}
    shared = [item for item in first if item in rank]
    pairs = len(shared) * (len(shared) - 1) // 2
    if pairs == 0:
        return 0.0
    discordant = sum(1 for i in range(len(shared)) for j in range(i + 1, len(shared))
                     if rank[shared[i]] > rank[shared[j]])
    return discordant / pairs


def adjusted_overlap(beta: float, gamma: float) -> float:
    return beta * (1.0 - gamma)


def cache_fix_overhead(alpha: float, cci: float, beta_adjusted: float) -> float:
    """CFO = alpha * CCI * (1 - beta'), clipped to [0, 1]: the share of the chunk to recompute."""
    return min(1.0, max(0.0, alpha * cci * (1.0 - beta_adjusted)))


def recompute_count(cfo: float, num_tokens: int) -> int:
    return min(num_tokens, math.ceil(cfo * num_tokens - 1e-9))


def tokens_to_recompute(inter: torch.Tensor, cfo: float) -> torch.Tensor:
    """Local indices of the top ceil(CFO |C|) tokens by inter-attention, ascending. Ties (a
    variant computed with no prior chunks has no inter-attention) go to the earliest tokens,
    which carry a chunk's spurious attention sink."""
    k = recompute_count(cfo, int(inter.shape[0]))
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    # a tiny position penalty breaks ties toward the start without reordering real scores
    scores = inter.float() - torch.arange(inter.shape[0], dtype=torch.float32) * 1e-9
    return torch.topk(scores, k).indices.sort().values


def focused_chunks(mass: Sequence[float]) -> frozenset[int]:
    """Chunks receiving at least an even share of the question's attention to fused chunks."""
    total = sum(mass)
    if total <= 0 or not mass:
        return frozenset()
    return frozenset(i for i, m in enumerate(mass) if m >= total / len(mass))


def termination_layer(history: Sequence[frozenset[int]], window: int) -> bool:
    """Algorithm 1's stop test: the focused set has been the same over the last `window` layers."""
    return len(history) >= window and all(h == history[-1] for h in history[-window:])


# --- variants ---------------------------------------------------------------------------------
def prefix_context(prefix_digests: Sequence[str]) -> str:
    """Cache-key context of a variant computed after these chunks (in this order)."""
    raw = "|".join(prefix_digests).encode()
    return "cc:" + hashlib.blake2b(raw, digest_size=12).hexdigest()


@dataclass
class Variant:
    tenant: str
    chunk_digest: str
    prefix: tuple[str, ...]  # digests of the chunks it was computed after, in order
    cci: float
    inter: torch.Tensor  # [n] per-token inter-attention, averaged over layers and heads
    key: CacheKey
    reuse_score: float = 0.0  # f_r


VARIANT_META = "cachecraft_variant"


def variant_to_meta(variant: Variant) -> str:
    """What a variant's file carries in its metadata to rebuild the index after a restart."""
    return json.dumps({"chunk": variant.chunk_digest, "prefix": list(variant.prefix), "cci": variant.cci,
                       "inter": [round(float(x), 6) for x in variant.inter]})


def variant_from_meta(text: str, tenant: str, make_key: Callable[[str, str, str], CacheKey]) -> Variant | None:
    """The variant a file's metadata describes (its key from `make_key(chunk digest, tenant,
    context)`), or None if the metadata is not a variant's."""
    try:
        data = json.loads(text)
        prefix = tuple(str(p) for p in data["prefix"])
        return Variant(tenant, str(data["chunk"]), prefix, float(data["cci"]),
                       torch.tensor(data["inter"], dtype=torch.float32),
                       make_key(str(data["chunk"]), tenant, prefix_context(prefix)))
    except (ValueError, KeyError, TypeError):
        return None


@dataclass
class Choice:
    variant: Variant
    beta: float
    gamma: float
    cfo: float


@dataclass
class VariantIndex:
    """Which variants exist per (tenant, chunk), and which to evict. The KV itself lives in the
    chunk store under each variant's key; evicted variants are returned so the caller drops it."""

    per_chunk: int = 4  # M
    max_chunks: int = 1024  # N: N * M variants in all
    _by_chunk: dict[tuple[str, str], list[Variant]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_chunk.values())

    def variants(self, tenant: str, chunk_digest: str) -> list[Variant]:
        return list(self._by_chunk.get((tenant, chunk_digest), []))

    def choose(self, tenant: str, chunk_digest: str, prefix_now: Sequence[str], alpha: float) -> Choice | None:
        best: Choice | None = None
        for variant in self._by_chunk.get((tenant, chunk_digest), []):
            beta = prefix_overlap(variant.prefix, prefix_now)
            gamma = kendall_tau_distance(variant.prefix, prefix_now)
            cfo = cache_fix_overhead(alpha, variant.cci, adjusted_overlap(beta, gamma))
            if best is None or cfo < best.cfo:
                best = Choice(variant, beta, gamma, cfo)
        return best

    def reward(self, variant: Variant, cfo: float) -> None:
        variant.reuse_score += 1.0 / max(cfo, 1e-3)

    def add(self, variant: Variant) -> list[Variant]:
        """Insert (replacing a variant with the same prefix); returns the variants evicted."""
        slot = self._by_chunk.setdefault((variant.tenant, variant.chunk_digest), [])
        evicted = [v for v in slot if v.prefix == variant.prefix]
        slot[:] = [v for v in slot if v.prefix != variant.prefix]
        if len(slot) >= self.per_chunk:
            loser = min(slot, key=lambda v: v.reuse_score)
            slot.remove(loser)
            evicted.append(loser)
        slot.append(variant)
        while len(self) > self.per_chunk * self.max_chunks:
            others = [v for vs in self._by_chunk.values() for v in vs if v is not variant]
            loser = min(others, key=lambda v: v.reuse_score)
            self.discard(loser)
            evicted.append(loser)
        return evicted

    def discard(self, variant: Variant) -> None:
        key = (variant.tenant, variant.chunk_digest)
        slot = self._by_chunk.get(key, [])
        if variant in slot:
            slot.remove(variant)
        if not slot:
            self._by_chunk.pop(key, None)

    def clear(self, tenant: str | None = None) -> None:
        if tenant is None:
            self._by_chunk.clear()
            return
        for key in [k for k in self._by_chunk if k[0] == tenant]:
            del self._by_chunk[key]


# --- recording during a prefill ---------------------------------------------------------------
@dataclass
class RecordedChunk:
    span_index: int
    chunk: Span
    prior: list[Span]
    prefix: tuple[str, ...]
    chunk_digest: str
    a_sum: float = 0.0
    b_sum: float = 0.0
    inter_sum: torch.Tensor | None = None
    layers: int = 0

    @property
    def cci(self) -> float:
        return cache_context_impact(self.a_sum / max(self.layers, 1), self.b_sum / max(self.layers, 1))

    @property
    def inter(self) -> torch.Tensor:
        assert self.inter_sum is not None
        return self.inter_sum / max(self.layers, 1)


class AttentionRecorder:
    """A `fused_prefill` observer: per layer, the attention rows of chunks computed fresh in this
    request (all their tokens are active on every layer), reduced to Cache-Craft's statistics."""

    def __init__(self, chunks: list[RecordedChunk]):
        self.chunks = chunks

    def __call__(self, layer: int, queries: torch.Tensor, active: torch.Tensor, keys: torch.Tensor) -> None:
        """queries [A, H, D] and keys [n, Hkv, D], both rotated; active [A] global positions."""
        heads, kv_heads, dim = queries.shape[1], keys.shape[1], queries.shape[2]
        for rec in self.chunks:
            start, end = rec.chunk
            rows = torch.searchsorted(active, torch.arange(start, end, device=active.device))
            q = queries[rows].float()  # [n, H, D]
            k = keys[:end].float().repeat_interleave(heads // kv_heads, dim=1)  # [end, H, D]
            logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
            causal = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
            probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=0).cpu()
            a, b, inter = layer_scores(probs, rec.chunk, rec.prior)
            rec.a_sum += a
            rec.b_sum += b
            rec.inter_sum = inter if rec.inter_sum is None else rec.inter_sum + inter
            rec.layers += 1
