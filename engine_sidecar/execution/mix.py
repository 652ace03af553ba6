"""Union of two recompute signals : CacheBlend's KV deviation and prophet's
question attention.

The two signals pick different tokens for different reasons: deviation finds tokens whose cached
KV is most wrong in this context (what changed), the question probe finds tokens the answer reads
(what matters). Their raw scales are unrelated (a squared value distance vs an attention share),
so they are combined by rank, not by value:

- `rank` (default): each candidate's percentile rank under either score is averaged, and the
  top-budget tokens by that average are recomputed (a token high on both beats one that tops a
  single list);
- `split`: half the budget goes to the question's top tokens, the other half to the highest
  deviation among the rest (each signal keeps its own best picks).

Pure functions on score vectors here; the Policy wrapper is `policies.MixPolicy`.
"""

from __future__ import annotations

import torch


def percentile_ranks(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """[N] in [0, 1]: a candidate's rank among the candidates by score, 1 for the highest, 0 for
    the lowest (equal scores share the mean of their ranks, so ties do not depend on position);
    non-candidates get -1. One candidate alone gets 1."""
    ranks = torch.full((scores.shape[0],), -1.0)
    idx = candidates.nonzero().squeeze(1)
    m = int(idx.numel())
    if m == 0:
        return ranks
    values = scores[idx].float().cpu()
    ordered = torch.sort(values).values
    # mean rank over ties, O(m log m): (strictly lower + lower-or-equal - 1) / 2
    lower = torch.searchsorted(ordered, values, right=False).float()
    upper = torch.searchsorted(ordered, values, right=True).float()
    position = (lower + upper - 1.0) / 2.0
    ranks[idx.cpu()] = position / (m - 1) if m > 1 else torch.ones(m)
    return ranks


def rank_average(a: torch.Tensor, b: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """[N]: the mean of the two percentile ranks on candidates, -1 elsewhere."""
    ra, rb = percentile_ranks(a, candidates), percentile_ranks(b, candidates)
    return torch.where(candidates.cpu(), (ra + rb) / 2.0, torch.full_like(ra, -1.0))


def select_mixed(question: torch.Tensor, deviation: torch.Tensor, candidates: torch.Tensor, budget: int,
                 mode: str = "rank") -> torch.Tensor:
    """Bool [N]: `budget` candidates chosen from the two scores (`rank` or `split`, module doc).

    All tensors are over the same N tokens (the active set at the check layer); the result is on
    the CPU."""
    candidates = candidates.cpu()
    chosen = torch.zeros(candidates.shape[0], dtype=torch.bool)
    budget = min(budget, int(candidates.sum()))
    if budget <= 0:
        return chosen
    if mode == "rank":
        combined = rank_average(question.cpu(), deviation.cpu(), candidates)
        # among equal averages the question's score decides, then position: two stable sorts
        # (the second, by the average, keeps the first's order among ties)
        idx = candidates.nonzero().squeeze(1)
        by_question = idx[torch.sort(-question.cpu().float()[idx], stable=True).indices]
        order = by_question[torch.sort(-combined[by_question], stable=True).indices]
        chosen[order[:budget]] = True
        return chosen
    if mode != "split":
        raise ValueError(f"unknown mix mode {mode!r}")
    half = (budget + 1) // 2  # the question's half gets the odd token: it is the stronger signal
    q = question.cpu().float().masked_fill(~candidates, float("-inf"))
    chosen[torch.topk(q, half).indices] = True
    rest = candidates & ~chosen
    if budget - half > 0:
        d = deviation.cpu().float().masked_fill(~rest, float("-inf"))
        chosen[torch.topk(d, budget - half).indices] = True
    return chosen
