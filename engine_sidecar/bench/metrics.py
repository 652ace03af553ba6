"""Answer-quality metrics: SQuAD-style EM / token F1 against gold, ROUGE-L between answers."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def exact_match(prediction: str, golds: list[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def token_f1(prediction: str, golds: list[str]) -> float:
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if not pred or not ref or common == 0:
            continue
        precision, recall = common / len(pred), common / len(ref)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


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


def bootstrap_ci(values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over questions (resampled with replacement,
    fixed seed so a table can be regenerated exactly)."""
    import random

    if not values:
        raise ValueError("no values")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    lo = means[int((1 - level) / 2 * resamples)]
    hi = means[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return lo, hi
