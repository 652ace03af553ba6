"""Adaptive recompute ratio: r0 on hand-computed cases, golden-section search on known functions,
and cost measurement on a real (tiny) engine."""

from __future__ import annotations

import math

import pytest

from engine_sidecar.calibrate.ratio_search import measure_costs
from engine_sidecar.execution.costs import CostMeter, golden_section_max, initial_ratio


@pytest.mark.parametrize("t_compute, t_load, expected", [
    (3.0, 1.0, 0.25),      # 1 / (3 + 1)
    (1.0, 1.0, 0.5),
    (9.0, 1.0, 0.15),      # 0.1 clipped up to r_min
    (0.0, 2.0, 1.0),       # loading is all the cost: recompute everything
])
def test_initial_ratio_is_load_share_clipped(t_compute, t_load, expected):
    assert initial_ratio(t_compute, t_load) == pytest.approx(expected)


def test_initial_ratio_respects_custom_bounds_and_rejects_nonsense():
    assert initial_ratio(1.0, 3.0, r_min=0.1, r_max=0.6) == pytest.approx(0.6)  # 0.75 clipped down
    with pytest.raises(ValueError):
        initial_ratio(0.0, 0.0)
    with pytest.raises(ValueError):
        initial_ratio(1.0, 1.0, r_min=0.5, r_max=0.2)


@pytest.mark.parametrize("peak", [0.15, 0.37, 0.9])
def test_golden_section_finds_the_peak_of_a_unimodal_function(peak):
    calls = []

    def f(r: float) -> float:
        calls.append(r)
        return -(r - peak) ** 2

    x, evals = golden_section_max(f, 0.0, 1.0, tol=1e-4)
    assert x == pytest.approx(peak, abs=1e-4)
    assert evals == len(calls)
    # one new evaluation per step: about log(tol)/log(1/phi) + 2
    assert evals <= math.ceil(math.log(1e-4) / math.log((math.sqrt(5) - 1) / 2)) + 2


def test_golden_section_on_a_plateau_edge_and_bad_bracket():
    x, _ = golden_section_max(lambda r: min(r, 0.4) - 0.5 * max(0.0, r - 0.4), 0.0, 1.0, tol=1e-3)
    assert x == pytest.approx(0.4, abs=2e-3)
    with pytest.raises(ValueError):
        golden_section_max(lambda r: r, 1.0, 0.0)


def test_measured_costs_are_positive_and_give_ratios_in_bounds(tiny_engine, tmp_path):
    costs = measure_costs(tiny_engine, "The Amazon river flows through Brazil into the Atlantic Ocean. " * 8,
                          tmp_path, repeats=2)
    assert costs.compute > 0 and costs.load_ram > 0 and costs.load_disk > 0
    ratios = costs.ratios()
    assert all(0.15 <= r <= 1.0 for r in ratios.values())


@pytest.mark.parametrize("argv, message", [(["--r-min", "3"], "--r-min must be between 0 and 1"),
                                           (["--repeats", "0"], "--repeats, --n and --k must be at least 1, --max-evals at least 2"),
                                           (["--max-evals", "1"], "--repeats, --n and --k must be at least 1, --max-evals at least 2")])
def test_calibrate_rejects_bad_options_in_one_line(argv, message):
    from engine_sidecar.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", *argv])
    assert str(exit_info.value) == f"ragcache calibrate: {message}"


def test_cost_meter_averages_and_gives_r0_per_tier():
    meter = CostMeter(weight=0.5)
    assert meter.ratio("disk") == 0.15  # nothing measured yet: r_min
    meter.observe_compute(2.0, 1000)  # 2 ms/token
    meter.observe_compute(4.0, 1000)  # EMA with weight 0.5: 3 ms/token
    assert meter.compute == pytest.approx(3e-3)
    meter.observe_load("disk", 1.0, 1000)  # 1 ms/token
    assert meter.ratio("disk") == pytest.approx(1 / 4)  # t_load / (t_compute + t_load)
    assert meter.ratio("ram") == 0.15
    meter.observe_load("ram", 0.0, 0)  # nothing loaded: ignored
    assert "ram" not in meter.load


def test_auto_ratio_comes_from_the_engines_own_measurements(tiny_engine):
    chunks = ["The Amazon river flows through Brazil into the Atlantic Ocean. " * 3,
              "The Danube flows through ten countries into the Black Sea. " * 3]
    first = tiny_engine.generate({"chunks": chunks, "question": "Where?"}, {"max_tokens": 1}, policy="cacheblend:auto")
    assert any(n.startswith("auto ratio 0.150") for n in first.stats.notes)
    assert tiny_engine.cache.costs.compute is not None and tiny_engine.cache.costs.compute > 0
    # the first ask computed its chunks in place; the second reuses them, which measures loading
    tiny_engine.generate({"chunks": chunks[::-1], "question": "Where?"}, {"max_tokens": 1}, policy="cacheblend:auto")
    assert tiny_engine.cache.costs.load["ram"] > 0
    again = tiny_engine.generate({"chunks": chunks, "question": "Where?"}, {"max_tokens": 1},
                                 policy="cacheblend:auto")
    expected = tiny_engine.cache.costs.ratio("ram")  # r_min on a CPU: loading is far cheaper than compute
    note = next(n for n in again.stats.notes if n.startswith("auto ratio"))
    assert f"auto ratio {expected:.3f} for the ram tier" in note and "compute" in note


def test_calibrate_refines_the_ratio_on_a_calibration_set(tiny_llama_dir, tmp_path):
    import json

    from engine_sidecar.cli.main import main

    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--model", str(tiny_llama_dir), "--no-disk", "--repeats", "1", "--data", "fanoutqa",
                 "--n", "2", "--k", "3", "--max-evals", "3", "--max-tokens", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    refined = result["refined"]
    assert len(refined["evaluations"]) == 3
    assert 0.15 <= refined["ratio"] <= 1.0
    for row in refined["evaluations"]:
        assert row["utility"] == pytest.approx(row["rouge_l_vs_full"] - 0.5 * row["ttft_vs_full"])
