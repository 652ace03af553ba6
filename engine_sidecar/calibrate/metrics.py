"""How close a policy's answer stays to full prefill's: ROUGE-L between two answers, and top-1
agreement and KL along full prefill's own answer (teacher-forced). Label-free: no gold answer is
read, so a user can run them on their own questions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _lcs(a: list[str], b: list[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            cur = row[j]
            row[j] = prev + 1 if x == y else max(row[j], row[j - 1])
            prev = cur
    return row[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 on lower-cased whitespace tokens (1.0 for two empty strings)."""
    cand, ref = candidate.lower().split(), reference.lower().split()
    if not cand and not ref:
        return 1.0
    lcs = _lcs(cand, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(cand), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def agreement_and_kl(logprobs: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || logprobs)) over answer positions."""
    agreement = (logprobs.argmax(-1) == reference.argmax(-1)).float().mean()
    kl = (reference.exp() * (reference - logprobs)).sum(-1).mean()
    return float(agreement), float(kl)
