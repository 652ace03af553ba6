"""The chatbot page's full-prefill estimate: a curve through a short and a long full prefill, so a
prompt four times the short one is not estimated at four times its cost when attention grows
faster than the length."""

from __future__ import annotations

import pytest

from examples.chatbot.service import FullPrefillCost


def _cost(n: int, a: float = 2.0, b: float = 0.001) -> tuple[int, float]:
    return n, (a * n + b * n * n) / 1000.0  # seconds for n tokens at a ms/token + b ms/token²


def test_the_curve_through_two_lengths_recovers_a_cost_growing_faster_than_the_length():
    cost = FullPrefillCost.fit(_cost(500), _cost(2000), measured_at=0.0)
    assert cost.ms_per_token == pytest.approx(2.0) and cost.ms_per_token_squared == pytest.approx(0.001)
    assert cost.estimate_s(1800) == pytest.approx(_cost(1800)[1])
    one_rate = 1800 * 1000.0 * _cost(500)[1] / 500 / 1000.0  # the old estimate: one short prompt's rate
    assert one_rate < 0.8 * _cost(1800)[1] <= cost.estimate_s(1800)


@pytest.mark.parametrize("short,long", [((500, 1.5), (2000, 4.0)),  # noise: cheaper per token when longer
                                        ((500, 0.01), (2000, 4.0)),  # a curve that would go below zero
                                        ((2000, 4.0), (500, 1.0))])  # either order
def test_noisy_measurements_never_give_a_negative_or_absurd_estimate(short, long):
    cost = FullPrefillCost.fit(short, long, measured_at=0.0)
    assert cost.ms_per_token >= 0 and cost.ms_per_token_squared >= 0
    assert cost.estimate_s(2000) == pytest.approx(4.0)  # through the longer measurement
    assert 0 < cost.estimate_s(100) < cost.estimate_s(1000) < cost.estimate_s(4000)
