"""Property tests (hypothesis) for the CA-Table and CacheTune's frequency scores: the sliding
window's counts always equal a brute-force recount of the last W requests, the frequency sort is
a stable permutation that puts equal chunk sets in the same order, and the scores of any cached
chunk are finite, non-negative and equal plain row norms when no frequency is cut."""

from __future__ import annotations

import math
from collections import Counter
from itertools import pairwise

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_sidecar.request.reorder import ChunkAccessTable
from engine_sidecar.store.frequency import frequency_scores

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ids = st.sampled_from([f"c{i}" for i in range(8)])
requests = st.lists(st.lists(ids, max_size=6), max_size=40)


def recount(history: list[list[str]], window: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    for request in history[-window:]:
        counts.update(set(request))  # a request counts a chunk once
    return counts


@SETTINGS
@given(history=requests, window=st.integers(1, 10))
def test_window_counts_equal_a_recount_of_the_last_w_requests(history, window):
    table = ChunkAccessTable(window)
    for i, request in enumerate(history):
        table.record(request)
        want = recount(history[: i + 1], window)
        assert {c: table.count(c) for c in want} == dict(want)
        assert len(table) == len(want)  # ids that left the window are forgotten (bounded memory)
        assert all(table.count(f"c{j}") == want.get(f"c{j}", 0) for j in range(8))


@SETTINGS
@given(history=requests, items=st.lists(ids, max_size=10), window=st.integers(1, 10), data=st.data())
def test_sort_is_a_stable_permutation_by_count_then_id(history, items, window, data):
    table = ChunkAccessTable(window)
    for request in history:
        table.record(request)
    tagged = list(enumerate(items))  # (input position, chunk id): duplicates stay distinguishable
    out = table.sort(tagged, key_of=lambda item: item[1])
    assert sorted(out) == tagged  # a permutation: nothing lost, nothing added
    keys = [(-table.count(cid), cid) for _, cid in out]
    assert keys == sorted(keys)  # most retrieved first, ties by id
    for a, b in pairwise(out):  # stable: equal ids keep the caller's order
        if a[1] == b[1]:
            assert a[0] < b[0]
    # the same set in any other order lines up identically (what makes prefixes repeat)
    shuffled = data.draw(st.permutations(sorted(set(items))))
    assert table.sort(shuffled, key_of=lambda c: c) == table.sort(sorted(set(items)), key_of=lambda c: c)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), n=st.integers(1, 12), cutoff=st.floats(0.0, 1.0), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_frequency_scores_are_finite_non_negative_and_exact_without_a_cut(layers, n, cutoff, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, n, 2, 4, generator=gen).to(dtype)
    values = torch.randn(layers, n, 2, 4, generator=gen).to(dtype)
    scores = frequency_scores(keys, values, cutoff)
    assert scores.shape == (n,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all() and (scores >= 0).all()
    full = frequency_scores(keys, values, 1.0)
    plain = ((keys.float().flatten(2).norm(dim=2) + values.float().flatten(2).norm(dim=2)) / 2).mean(dim=0)
    assert torch.allclose(full, plain, atol=1e-4, rtol=1e-4)
    if math.ceil(cutoff * (n // 2 + 1)) <= 1:  # only the mean is kept: every token scores the same
        assert torch.allclose(scores, scores[0].expand(n), atol=1e-4, rtol=1e-4)
