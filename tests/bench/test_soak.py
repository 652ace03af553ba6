"""The soak benchmark, briefly: a real `ragcache serve` (tiny model, budgets of a few chunks)
under 2 concurrent clients for a few seconds answers no request with a 5xx, answers every invalid
request with a 4xx, and keeps its RAM tier and cache folder within their budgets in every sample."""

from __future__ import annotations

import json

from ragcache_lab import soak


def test_a_short_soak_has_no_5xx_and_keeps_its_budgets(tiny_llama_dir, tmp_path):
    words = "river mountain city harbour museum bridge forest castle valley island".split()
    records = [{"question": f"Where is the {words[i]} of record {i}?",
                "ctxs": [{"title": f"Doc {i}-{j}", "text": " ".join(words[(i + j + n) % 10] for n in range(60))}
                         for j in range(4)]} for i in range(8)]
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(records))
    # a passage's KV is ~60 KiB with this model: the RAM tier holds ~8, the disk budget ~12 files
    args = soak.parser().parse_args([
        "--clients", "2", "--seconds", "12", "--model", str(tiny_llama_dir), "--corpus", str(corpus),
        "--ram-cache-gb", str(512 / (1 << 20)), "--disk-cache-gb", str(1 / 1024), "--conversations", "2",
        "--conversation-ram-gb", str(1 / 1024), "--max-tokens", "4", "--sample-every", "0.5",
        "--out", str(tmp_path / "out"), "--progress", "0"])
    args.minutes = args.seconds / 60
    report = soak.run(args)
    v = report["verdict"]
    assert v["server_errors"] == 0, v["server_error_examples"]
    assert v["valid_requests_refused_4xx"] == 0, v["valid_4xx_examples"]
    assert v["ram_within_budget"] and v["ram_peak_bytes"] > 0
    assert v["disk_within_budget"] and v["disk_index_peak_bytes"] > 0, v
    assert v["server_alive_at_end"] and v["samples"] >= 5 and v["stats_failures"] == 0
    done, sent = map(int, v["invalid_answered_4xx"].split("/"))
    assert done == sent
    assert v["requests"] >= 10 and {"generate", "conversation"} <= set(v["by_kind"])
    table = (tmp_path / "out" / "soak.md").read_text()
    assert "verdict:" in table and "| 5xx or transport errors | 0 |" in table
    assert json.loads((tmp_path / "out" / "soak.json").read_text())["samples"]
