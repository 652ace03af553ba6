"""Answer-quality metrics against gold answers: SQuAD-style EM and token F1, and a bootstrap
interval over questions. ROUGE-L between two answers is the product's (engine_sidecar/calibrate/metrics.py):
`ragcache check` reports it too."""

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
