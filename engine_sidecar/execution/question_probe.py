"""Question-driven multi-layer token selection (ProphetKV, A3, CacheClip windows).

A cheap probe runs first: the tokens without cached KV (the question, fresh chunks) go through
every layer attending over the *reused* KV, exactly as under `reuse`. At each layer the question
tokens' attention over the fused tokens is read out, normalized per head (each head's
distribution over the fused tokens sums to 1, so one sharp head or a head that mostly looks at
the system prompt does not dominate) and averaged over heads; layers are then averaged (each
layer's scores sum to 1). The top fused tokens by that score, each with a small window of
neighbours (CacheClip), are then recomputed from layer 0 on every layer; the rest keep their
cached KV.

The probe costs (question + fresh tokens) x layers token-layers, 1-2% of a RAG prompt; it is
counted in the request's computed share. Its time is more than that share: every probed layer's
attention runs over all cached keys. So the probe reads the prefill's own KV buffer (the cached
keys are rotated once, for both), scores all query heads of a KV head in one matmul, and `layers`
stops it after the first L layers (`probeL` in the policy grammar), its cost about proportional
to L.

This module computes and selects; the Policy wrappers are `policies.ProphetPolicy`,
`policies.MixPolicy` and `policies.GatePolicy` (which also reads the probe's prediction of the
first answer token: under `reuse` the model would answer exactly that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_sidecar.execution.plan import FusionPlan
from ragcache_kernels.attention import position_mask
from ragcache_kernels.dispatch import apply_rope

if TYPE_CHECKING:
    from engine_sidecar.model.runner import ModelRunner


@dataclass(frozen=True)
class VisibleKeys:
    """Which keys the probed rows may not see. Positions do not change between layers, so the
    probe works this out once, not per layer: reading it back from the device every layer would
    stall a GPU. Only the keys from the first one some row cannot see are masked (the question's
    own tokens, at the end): a broadcast mask over all keys cost as much as the matmul."""

    first: int  # the first key some row cannot see (n when every row sees every key)
    hidden_tail: torch.Tensor  # [R, n - first] bool: keys from `first` on that each row cannot see
    blind: bool  # some row sees no key at all (its softmax row is NaN until zeroed)

    @classmethod
    def of(cls, query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> VisibleKeys:
        hidden = ~position_mask(query_pos, key_pos, sliding_window)  # [R, n]
        some = hidden.any(dim=0)
        first = int(some.int().argmax()) if bool(some.any()) else hidden.shape[1]
        return cls(first, hidden[:, first:], bool(hidden.all(dim=1).any()))


def attention_scores(q: torch.Tensor, k: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                     fused: torch.Tensor, sliding_window: int | None = None,
                     visible: VisibleKeys | None = None) -> torch.Tensor:
    """Per key [n]: the readers' attention on the fused keys, normalized per head.

    q [R, H, D] rotated queries of the reading tokens, k [n, Hkv, D] rotated keys of every token,
    fused [n] bool. Each head's softmax over the visible keys is averaged over the readers,
    restricted to the fused keys and rescaled to sum to 1 there (a head with no mass on fused
    keys contributes nothing); heads are then averaged, so the result sums to 1 over the fused
    keys (0 elsewhere) unless no head sees a fused key. `visible`: the mask of these positions,
    made once for many calls."""
    probs = _grouped_probs(q, k, visible or VisibleKeys.of(query_pos, key_pos, sliding_window))
    return _fused_scores(probs, q.shape[1] // k.shape[1], None, fused)


def probe_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                    key_pos: torch.Tensor, readers: torch.Tensor, fused: torch.Tensor,
                    sliding_window: int | None = None,
                    visible: VisibleKeys | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [n] as `attention_scores` of the `readers` rows, attention output [C, H, D] in q's
    dtype) of the probed tokens q [C, H, D] over k/v [n, Hkv, D], from one fp32 softmax.
    `readers`: bool [C], or the indices of those rows.

    The probe needs both from every layer; a separate attention call repacked all n keys per
    layer for ~30 queries and cost as much as the scores themselves."""
    probs = _grouped_probs(q, k, visible or VisibleKeys.of(query_pos, key_pos, sliding_window))  # [Hkv, group x C, n]
    kv_heads = probs.shape[0]
    group = q.shape[1] // kv_heads
    work = _matmul_dtype(v)
    out = torch.bmm(probs.to(work), v.transpose(0, 1).to(work))  # [Hkv, group x C, D]
    out = out.view(kv_heads, group, q.shape[0], -1).permute(2, 0, 1, 3).reshape(q.shape)
    return _fused_scores(probs, group, readers, fused), out.to(q.dtype)


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The probe's attention output is multiplied in the model's half precision where it has one
    (the probabilities rounded as transformers' eager attention rounds them): converting every
    value to fp32 and multiplying there was a large share of the probe's time on a CPU in bf16."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _grouped_probs(q: torch.Tensor, k: torch.Tensor, visible: VisibleKeys) -> torch.Tensor:
    """fp32 softmax [Hkv, group x R, n] of q [R, H, D] over k [n, Hkv, D]; row g x R + r is query
    head kv x group + g of reader r (repeat_interleave's order). Masked-out keys get 0."""
    readers, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # grouped-query attention without repeating the keys: the query heads of one KV head are one
    # batched matmul [Hkv, group x R, D] x [Hkv, D, n] (repeating fp32 keys per query head was
    # half the score's time). In fp32: the scores pick the tokens, and bf16 logits moved picks.
    qg = q.float().view(readers, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * readers, dim)
    logits = torch.matmul(qg, k.permute(1, 2, 0).float()).mul_(1.0 / math.sqrt(dim))
    first = visible.first
    logits[:, :, first:].masked_fill_(visible.hidden_tail.repeat(group, 1), float("-inf"))  # rows (g, r) as in qg
    probs = torch.softmax(logits, dim=-1)
    # a row that sees no key is NaN: zeros instead (a pass over every probability per layer was a
    # tenth of the probe's time, so only where such a row exists)
    return probs.nan_to_num_(0.0) if visible.blind else probs


def _fused_scores(probs: torch.Tensor, group: int, readers: torch.Tensor | None, fused: torch.Tensor) -> torch.Tensor:
    """[n] from probs [Hkv, group x R, n]: the rows of `readers` (bool [R] or row indices; all when
    None) averaged per head, restricted to the fused keys and rescaled to sum to 1 there (a head
    with no mass on fused keys contributes nothing), then averaged over heads."""
    kv_heads, rows, n = probs.shape
    per_row = probs.view(kv_heads, group, rows // group, n)
    if readers is not None:
        per_row = per_row[:, :, readers.to(probs.device)]
    # head h = kv head h // group, member h % group (repeat_interleave's order)
    per_head = per_row.mean(dim=2).reshape(kv_heads * group, n) * fused.to(probs.device)  # [H, n]
    total = per_head.sum(dim=1, keepdim=True)
    per_head = torch.where(total > 0, per_head / total.clamp_min(1e-30), per_head)
    return per_head.mean(dim=0)


def reader_mask(plan: FusionPlan) -> torch.Tensor:
    """Bool [T]: the question's tokens; without a question span, the last computed span's tokens."""
    readers = torch.zeros(plan.num_tokens, dtype=torch.bool)
    for span in plan.spans:
        if span.kind == "question":
            readers[span.start : span.end] = True
    if not bool(readers.any()):
        for span in reversed(plan.spans):
            if span.mode == "fresh" or span.cached is None:
                readers[span.start : span.end] = True
                break
    return readers


@dataclass
class ReusedKV:
    """The prefill's KV buffer lent to the probe, so the cached keys are not copied and rotated a
    second time: keys [L, n, Hkv, D] rotated to their global positions and values [L, n, Hkv, D].
    Rows of cached tokens hold their cached KV and are only read; the other rows are scratch the
    probe writes (the prefill computes those tokens on every layer and overwrites them)."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class Probe:
    scores: torch.Tensor  # [T] over the fused tokens (0 elsewhere), averaged over the probed layers
    token_layers: int  # computed, counted in the request's computed share
    # [vocab] next-token logits of the last prompt token over the reused KV: what `reuse` predicts
    # for the first answer token (only when asked for, the whole depth probed and that token uncached)
    logits: torch.Tensor | None = None


def probe_scores(runner: ModelRunner, plan: FusionPlan, layers: int | None = None,
                 reused: ReusedKV | None = None) -> tuple[torch.Tensor, int]:
    """(scores [T] over the fused tokens, token-layers computed) from a probe of the uncached
    tokens over the reused KV in the first `layers` layers (all by default)."""
    result = probe(runner, plan, layers, reused=reused)
    return result.scores, result.token_layers


def _cached_and_fused(plan: FusionPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows holding cached KV and the rows of fused chunks ([T] bool each, on the host);
    cached KV still on disk is read whole now, since the probe reads every layer of it."""
    cached = torch.zeros(plan.num_tokens, dtype=torch.bool)
    fused = torch.zeros(plan.num_tokens, dtype=torch.bool)
    for span in plan.spans:
        if span.cached is not None and span.mode != "fresh":
            cached[span.start : span.end] = True
            if span.cached.reader is not None:
                span.cached.reader.read_into(span.cached)
        if span.mode == "fuse":
            fused[span.start : span.end] = True
    return cached, fused


@torch.inference_mode()
def probe(runner: ModelRunner, plan: FusionPlan, layers: int | None = None, logits: bool = False,
          reused: ReusedKV | None = None) -> Probe:
    """The question probe (`probe_scores`); with `logits`, the last layer is also finished for the
    last prompt token and its next-token logits returned (the gate policy's confidence check).
    With `reused` (the prefill's buffer) the cached KV is read there; without, from the plan's
    entries into a buffer of the probe's own."""
    n = plan.num_tokens
    device = runner.device
    cached, fused = _cached_and_fused(plan)
    computed = (~cached).nonzero().squeeze(1)
    readers = reader_mask(plan)[computed]
    depth = runner.num_layers if layers is None else max(0, min(layers, runner.num_layers))
    scores = torch.zeros(n)
    if not bool(fused.any()) or not bool(readers.any()) or depth == 0:
        return Probe(scores, 0)
    if reused is not None and tuple(reused.keys.shape[:2]) != (runner.num_layers, n):
        raise ValueError(f"reused KV holds {tuple(reused.keys.shape[:2])} (layers, tokens), "
                         f"the plan needs {(runner.num_layers, n)}")
    # reuse's prediction needs the last prompt token through every layer; a cached last token
    # (never under a plan the executor accepts) has no prediction to offer
    finish_last = logits and depth == runner.num_layers and not bool(cached[n - 1])
    c = runner.config
    ids = plan.token_tensor().to(device)
    positions = torch.arange(n, device=device)
    rope = runner.rope_tables(positions)
    computed = computed.to(device)
    reader_rows = readers.nonzero().squeeze(1).to(device)  # indices: boolean indexing would sync a GPU per layer
    rope_c, pos_c = rope.take(computed), positions[computed]
    # the masks once per window, not per layer (positions do not change); scores summed on the device
    windows = set(runner.layer_windows)
    visible = {w: VisibleKeys.of(pos_c, positions, w) for w in windows}
    visible_readers = {w: VisibleKeys.of(pos_c[reader_rows], positions, w) for w in windows}
    summed = torch.zeros(n, device=device)
    fused_d = fused.to(device)
    hidden = runner.embed(ids[computed])
    own_keys = own_values = None
    if reused is None:
        own_keys = torch.empty(n, c.num_kv_heads, c.head_dim, dtype=runner.dtype, device=device)
        own_values = torch.empty_like(own_keys)
    # the class's step, not the instance attribute: a wrapper observing the prefill's layers on
    # the instance (bench fidelity's per-layer hidden-state capture and its TTFT stamps) must see
    # the prefill proper, not the probe before it
    mlp = type(runner).mlp
    next_logits = None
    for layer in range(depth):
        qkv = runner.qkv(layer, hidden)
        cos_c, sin_c = rope_c.at(layer)
        window = runner.window(layer)
        q = apply_rope(qkv.q, cos_c, sin_c)
        if reused is not None:
            rotated, values = reused.keys[layer], reused.values[layer]
            rotated[computed] = apply_rope(qkv.k, cos_c, sin_c)  # RoPE is per row: as rotating all
            values[computed] = qkv.v
        else:
            assert own_keys is not None and own_values is not None
            keys, values = own_keys, own_values
            for span in plan.spans:
                if span.cached is not None and span.mode != "fresh":
                    keys[span.start : span.end] = span.cached.keys[layer]
                    values[span.start : span.end] = span.cached.values[layer]
            keys[computed], values[computed] = qkv.k, qkv.v
            rotated = apply_rope(keys, *rope.at(layer))
        if layer + 1 < depth or finish_last:
            # the readers' scores and every probed token's attention output from one softmax
            layer_scores, attn = probe_attention(q, rotated, values, pos_c, positions, reader_rows, fused_d,
                                                 window, visible[window])
            summed += layer_scores
            if layer + 1 < depth:
                hidden = mlp(runner, layer, runner.attn_out(layer, hidden, attn.reshape(attn.shape[0], -1)))
            else:
                # of the last layer only the last token's output is read (its logits): one row, not all
                last = mlp(runner, layer, runner.attn_out(layer, hidden[-1:], attn[-1:].reshape(1, -1)))
                next_logits = runner.logits(last)[0]
        else:
            summed += attention_scores(q[reader_rows], rotated, pos_c[reader_rows], positions, fused_d,
                                       window, visible_readers[window])
    return Probe(summed.cpu() / depth, int(computed.shape[0]) * depth, next_logits)


def first_token_margin(logits: torch.Tensor) -> float:
    """p(top 1) - p(top 2) under the softmax of `logits` [vocab]: how sure the prediction is."""
    top = torch.topk(torch.softmax(logits.float(), dim=-1), 2).values
    return float(top[0] - top[1])


def select_with_windows(scores: torch.Tensor, candidates: torch.Tensor, budget: int, radius: int,
                        segments: list[tuple[int, int]]) -> torch.Tensor:
    """Bool [T]: at most `budget` candidate tokens, taken in descending score order, each pick
    with its neighbours within `radius` in the same segment (CacheClip's windows; a window that
    would pass the budget is cut at it). radius 0 is a plain top-budget."""
    chosen = torch.zeros(scores.shape[0], dtype=torch.bool)
    budget = min(budget, int(candidates.sum()))
    if budget <= 0:
        return chosen
    masked = scores.float().masked_fill(~candidates, float("-inf"))
    if radius <= 0:
        chosen[torch.topk(masked, budget).indices] = True
        return chosen
    segment_of = torch.full((scores.shape[0],), -1, dtype=torch.long)
    for i, (s, e) in enumerate(segments):
        segment_of[s:e] = i
    order = torch.argsort(masked, descending=True, stable=True).tolist()
    count = 0
    for centre in order:
        if count >= budget or not bool(candidates[centre]):
            break
        seg = int(segment_of[centre])
        # the pick first, then its neighbours nearest first
        for j in [centre] + [centre + d * s for d in range(1, radius + 1) for s in (-1, 1)]:
            if count >= budget:
                break
            if 0 <= j < chosen.shape[0] and not bool(chosen[j]) and bool(candidates[j]) \
                    and int(segment_of[j]) == seg:
                chosen[j] = True
                count += 1
    return chosen
