"""`ragcache bench gpu --sections serve` as a CPU dry run (tiny shape, the sidecar's app on a loopback
port), and the parts it is built from: the Zipf draw of a request's passages, the Poisson schedule,
the per-token gaps and reserved KV of traced requests, and the flags' checks."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from engine_sidecar.cli.main import main
from ragcache_integrations.policy_registry import DEFAULT_POLICY
from ragcache_lab.closed_loop import RequestTrace
from ragcache_lab.open_loop import poisson_arrivals, row_stats, zipf_draw

POLICIES = (DEFAULT_POLICY, "full")


def test_the_serve_dry_run_reports_both_loads_for_both_policies(smol_dir, tmp_path):
    out = tmp_path / "gpu"
    assert main(["bench", "gpu", "--device", "cpu", "--quick", "--sections", "serve", "--tokenizer", str(smol_dir),
                 "--out", str(out)]) == 0
    report = json.loads((out / "bench-gpu.json").read_text())
    serve = report["serve_tiny"]
    assert serve["tokens"] == [4, 6] and serve["corpus"] == 8 and serve["passages"] == 3
    rows = {(r["mode"], r["load"], r["policy"]): r for r in serve["rows"]}
    assert set(rows) == {(mode, load, policy) for mode, load in (("closed", 1), ("closed", 2), ("open", 4.0))
                         for policy in POLICIES}
    for (mode, load, policy), row in rows.items():
        assert row["errors"] == 0 and row["first_error"] is None and row["over_timeout"] == 0, row
        if mode == "closed":
            assert row["requests"] == load * 1  # --quick: one request per client
        else:
            assert row["requests"] == 8  # max(8, 2 s x 4/s)
        assert 4 * row["requests"] <= row["output_tokens"] <= 6 * row["requests"]
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
        assert row["output_tokens_per_s"] > 0 and row["requests_per_s"] > 0
        # the engine's own count: rows written never exceed the rows reserved for them
        assert 0 < row["peak_kv_used_bytes"] <= row["peak_kv_bytes"]
        assert row["floor_tokens_per_s"] > 0 and row["floor_step_ms"] > 0 and row["achieved_vs_floor"] > 0
        if policy == "full":
            assert row["chunk_hits"] == 0 and row["tokens_reused"] == 0 and row["chunk_hit_ratio"] == 0
        else:  # the corpus was warmed before the first request
            assert row["chunk_hit_ratio"] > 0 and row["tokens_reused"] > 0
        # the same request list for both policies: the same prompts, the same drawn lengths
        other = rows[(mode, load, POLICIES[policy == DEFAULT_POLICY])]
        assert (row["prompt_tokens"], row["output_tokens"]) == (other["prompt_tokens"], other["output_tokens"])
    table = (out / "bench-gpu.md").read_text()
    assert "Serve, tiny shape: streamed `/v1/generate`, 3 of 8 warmed passages" in table
    assert f"| 2 clients | {DEFAULT_POLICY} | 2 | 0 | 0 |" in table and "| 4/s open | full | 8 | 0 | 0 |" in table


def test_the_serve_dry_run_on_the_block_pool_counts_blocks_and_what_fits(smol_dir, tmp_path):
    out = tmp_path / "gpu"
    assert main(["bench", "gpu", "--device", "cpu", "--quick", "--sections", "serve", "--tokenizer", str(smol_dir),
                 "--serve-kv-block-size", "16", "--serve-policies", DEFAULT_POLICY, "--serve-rates", "4",
                 "--out", str(out)]) == 0
    serve = json.loads((out / "bench-gpu.json").read_text())["serve_tiny"]
    assert serve["kv_block_size"] == 16 and serve["rows"]
    for row in serve["rows"]:
        assert row["errors"] == 0 and row["over_timeout"] == 0, row
        assert row["peak_kv_blocks"] >= 1 and row["preemptions"] >= 0
        # blocks held are whole blocks of the rows written
        assert 0 < row["peak_kv_used_bytes"] <= row["peak_kv_bytes"]
    fit = serve["fit"]
    assert fit["block_pool"] == fit["paged_engine_estimate"] >= fit["buffers"] >= 1  # both in 16-row blocks here
    assert "held as blocks of 16 rows" in (out / "bench-gpu.md").read_text()


def test_requests_that_fit_is_the_stated_arithmetic():
    import torch

    from ragcache_lab.gpu_serve import requests_that_fit

    shape = {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 4}  # 8 elements a row and tensor
    fit = requests_that_fit(shape, torch.float32, 6_400, prompt_rows=20, answer=(4, 11), block_size=8)
    # a row is 2 layers x 1 head x 4 x 4 bytes = 32 bytes per tensor; reserved: 20 + 11 + 1 = 32 rows
    assert (fit["reserved_rows"], fit["mean_rows"]) == (32, 27)
    assert fit["buffers"] == 6_400 // (3 * 32 * 32) == 2
    assert fit["block_pool"] == (6_400 // (2 * 32 * 8)) // 4 == 3  # 12 blocks of 8 rows; 27 rows take 4
    assert fit["paged_engine_estimate"] == (6_400 // (2 * 32 * 16)) // 2 == 3  # 6 blocks of 16; 27 rows take 2


def test_a_zipf_draw_is_distinct_popular_first_and_seeded():
    rng = random.Random(7)
    draws = [zipf_draw(rng, 20, 5) for _ in range(4000)]
    assert all(len(set(d)) == 5 and all(0 <= i < 20 for i in d) for d in draws)
    counts = Counter(i for d in draws for i in d)
    assert counts.most_common(1)[0][0] == 0 and counts[0] > counts[5] > counts[19]
    # the order within a request is its own, not by popularity
    assert sum(d[0] == min(d) for d in draws) < 0.5 * len(draws)
    assert zipf_draw(random.Random(3), 20, 5) == zipf_draw(random.Random(3), 20, 5)
    assert [zipf_draw(random.Random(3), 20, 5) for _ in range(3)] != [zipf_draw(random.Random(s), 20, 5)
                                                                      for s in (4, 5, 6)]
    assert sorted(zipf_draw(random.Random(1), 6, 6)) == list(range(6))
    with pytest.raises(ValueError):
        zipf_draw(random.Random(1), 3, 4)


def test_poisson_arrivals_have_a_mean_gap_of_one_over_the_rate():
    for rate in (0.5, 4.0):
        at = poisson_arrivals(rate, 20000, random.Random(11))
        gaps = [b - a for a, b in zip([0.0, *at], at, strict=False)]
        assert all(g > 0 for g in gaps)
        assert sum(gaps) / len(gaps) == pytest.approx(1 / rate, rel=0.03)
        # exponential gaps: their standard deviation is their mean
        mean = sum(gaps) / len(gaps)
        assert (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 == pytest.approx(mean, rel=0.05)
    assert poisson_arrivals(2.0, 5, random.Random(1)) == poisson_arrivals(2.0, 5, random.Random(1))


def test_token_gaps_spread_an_event_over_the_tokens_it_carried():
    one_each = RequestTrace(0.0, events=[1.0, 1.1, 1.3], end=1.3, tokens=3)
    assert one_each.ttft_s == 1.0 and one_each.token_gaps() == pytest.approx([0.1, 0.2])
    # 5 tokens in 3 events: the 4 after the first came in 2 events, 2 tokens each
    held_back = RequestTrace(0.0, events=[1.0, 1.2, 1.6], end=1.6, tokens=5)
    assert held_back.token_gaps() == pytest.approx([0.1, 0.2])
    assert RequestTrace(0.0, events=[1.0], end=1.0, tokens=1).token_gaps() == []


def test_failures_count_apart():
    a = RequestTrace(0.0, max_tokens=10, events=[1.0, 2.0], end=3.0, tokens=10, prompt_tokens=89)  # 100 rows
    b = RequestTrace(0.5, max_tokens=10, events=[2.5], end=4.0, tokens=10, prompt_tokens=39)  # 50 rows
    c = RequestTrace(3.5, max_tokens=10, events=[3.5], end=5.0, tokens=10, prompt_tokens=189)  # 200, after a
    failed = RequestTrace(0.0, max_tokens=10, end=700.0, error="ServerError: boom")
    stats = row_stats([a, b, c, failed], wall_s=5.0, timeout_s=600.0)
    assert (stats["requests"], stats["errors"], stats["first_error"], stats["over_timeout"]) == (4, 1, "ServerError: "
                                                                                                 "boom", 1)
    assert stats["output_tokens"] == 30 and stats["mean_concurrency"] == pytest.approx((3.0 + 3.5 + 1.5) / 5.0)


@pytest.mark.parametrize("flag,value,message", [("--serve-tokens", "9-3", "--serve-tokens: LO-HI"),
                                                ("--serve-tokens", "0-3", "--serve-tokens: LO-HI"),
                                                ("--serve-tokens", "many", "--serve-tokens: LO-HI"),
                                                ("--serve-rates", "0", "--serve-rates: requests per second above 0"),
                                                ("--serve-rates", "2,-1", "--serve-rates: requests per second"),
                                                ("--serve-rates", "fast", "--serve-rates: a comma list"),
                                                ("--serve-clients", "0", "--serve-clients"),
                                                ("--serve-corpus", "-2", "--serve-corpus"),
                                                ("--serve-passages", "9", "--serve-passages: at most --serve-corpus"),
                                                ("--serve-policies", "full,cacheblend:2", "--serve-policies")])
def test_bad_serve_flags_are_one_line_before_any_work(tmp_path, capsys, flag, value, message):
    assert main(["bench", "gpu", "--device", "cpu", "--quick", "--sections", "serve", flag, value,
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "bench-gpu.json").exists()
