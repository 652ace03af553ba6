"""Pieces of the workload benchmark that decide what it reports."""

from __future__ import annotations

import json

import pytest

from engine_sidecar.calibrate.metrics import rouge_l
from ragcache_lab.metrics import exact_match, token_f1
from ragcache_lab.stream import build_stream, load_corpus, overlap_fractions
from ragcache_lab.workload import SystemLog, workload_summary


def test_overlap_fractions_separate_prefix_alignment_from_total_overlap():
    orders = [["a", "b", "c"], ["a", "b", "d"], ["d", "a", "b"]]
    aligned, total = overlap_fractions(orders)
    # request 2: "a","b" continue request 1's prefix; request 3 starts with d: no aligned prefix
    assert aligned == pytest.approx(2 / 9)
    # request 2: a, b seen; request 3: d, a, b seen
    assert total == pytest.approx(5 / 9)


def test_metrics_on_hand_computed_cases():
    assert exact_match("The Exeter College.", ["Exeter College"]) == 1.0
    assert token_f1("exeter college oxford", ["Exeter College"]) == pytest.approx(0.8)
    assert rouge_l("a b c d", "a c d") == pytest.approx(2 * (3 / 4) * 1.0 / (3 / 4 + 1.0))
    assert rouge_l("", "") == 1.0 and rouge_l("x", "y") == 0.0


def test_summary_fields_match_the_documented_json_shape():
    log = SystemLog(ttft=[1.0, 3.0], computed=[1.0, 0.5], hits=1, lookups=4, orders=[["a"], ["a"]],
                    answers=["x", "y"])
    out = workload_summary({"full": log})
    assert set(out["full"]) >= {"ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "computed_fraction", "chunk_hit_ratio",
                                "prefix_aligned_fraction", "total_overlap_fraction"}
    assert out["full"]["ttft_mean_s"] == 2.0 and out["full"]["chunk_hit_ratio"] == 0.25


def test_stream_is_deterministic_with_zipf_popularity_and_conversations(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path))
    records = [{"question": f"question about topic {i}?",
                "ctxs": [{"title": f"t{i}-{j}", "text": f"passage {j} about topic {i}"} for j in range(3)]}
               for i in range(8)]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(records))
    corpus = load_corpus(path)
    assert len(corpus.passages) == 24
    one = build_stream(corpus, 30, 2, zipf=1.2, turns=2, conversation_share=0.3, question_pool=8, seed=3)
    two = build_stream(corpus, 30, 2, zipf=1.2, turns=2, conversation_share=0.3, question_pool=8, seed=3)
    assert one == two and len(one) == 30
    assert any(r.conversation_id for r in one) and all(len(r.chunk_ids) == 2 for r in one)
    counts = {q: sum(1 for r in one if r.question == q and r.turn == 1) for q in corpus.questions}
    assert counts[corpus.questions[0]] >= counts[corpus.questions[-1]]


def _records(n: int, per: int = 3) -> list[dict]:
    return [{"question": f"question about topic {i}?", "answers": ["x"],
             "ctxs": [{"title": f"t{i}-{j}", "text": f"passage {j} about topic {i}"} for j in range(per)]}
            for i in range(n)]


def test_document_stream_asks_new_questions_over_one_document_set(tmp_path, monkeypatch):
    from ragcache_lab.stream import build_document_stream

    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path))
    path = tmp_path / "c.jsonl"  # JSONL reads like JSON
    path.write_text("\n".join(json.dumps(r) for r in _records(12)))
    corpus = load_corpus(path)
    assert len(corpus.questions) == 12 and len(corpus.record_passages[0]) == 3
    stream = build_document_stream(corpus, 20, 2, documents=3, seed=1)
    assert stream == build_document_stream(corpus, 20, 2, documents=3, seed=1)
    pool = {pid for r in stream for pid in r.chunk_ids}
    assert len(pool) <= 9  # only the 3 picked records' passages
    first_round = [r.question for r in stream[:12]]
    assert len(set(first_round)) == 12  # no question repeats before every question was asked
    _, total = overlap_fractions([list(r.chunk_ids) for r in stream])
    assert total > 0.5  # passages recur


def test_per_document_stream_asks_each_question_of_one_document(tmp_path, monkeypatch):
    from ragcache_lab.stream import build_per_document_stream

    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_records(12, per=5)))
    corpus = load_corpus(path)
    stream = build_per_document_stream(corpus, 40, 3, documents=4, seed=2)
    assert stream == build_per_document_stream(corpus, 40, 3, documents=4, seed=2)
    assert stream != build_per_document_stream(corpus, 40, 3, documents=4, seed=3)
    owner = {pid: i for i, ids in enumerate(corpus.record_passages) for pid in ids}
    documents = [{owner[pid] for pid in r.chunk_ids} for r in stream]
    assert all(len(d) == 1 for d in documents)  # every request's passages come from one record
    assert len(set().union(*documents)) == 4  # and the requests spread over the 4 picked records
    assert all(len(set(r.chunk_ids)) == 3 for r in stream)
    assert len({r.question for r in stream[:12]}) == 12  # no question repeats before every one was asked


def test_summary_reports_cold_and_warm_phases():
    log = SystemLog(ttft=[4.0, 2.0, 1.0, 1.0], computed=[1.0, 1.0, 0.2, 0.4], orders=[["a"]] * 4, answers=["x"] * 4)
    out = workload_summary({"fusion": log, "vllm-apc+reorder": SystemLog(ttft=[2.0] * 4, computed=[1.0] * 4,
                                                                   orders=[["a"]] * 4, answers=["x"] * 4)}, cold=2)
    m = out["fusion"]
    assert m["cold_ttft_mean_s"] == 3.0 and m["warm_ttft_mean_s"] == 1.0 and m["ttft_mean_s"] == 2.0
    assert m["warm_computed_fraction"] == pytest.approx(0.3)
    assert m["warm_ttft_mean_ratio_vs_vllm-apc+reorder"] == 0.5


def test_workload_corpus_errors_are_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"no": "question"}\n')
    for corpus in (str(bad), str(tmp_path / "missing.json")):
        run = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "bench", "workload", "--corpus", corpus,
                              "--systems", "full"], capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
        assert corpus.split("/")[-1] in run.stderr


def test_workload_run_writes_every_requests_ttft_computed_and_stage_times(tmp_path, tiny_llama_dir):
    """A whole `bench workload` run on the tiny model: the JSON keeps one row per request and
    system, whose means are the table's (so a phase's mean can be looked into)."""
    import statistics
    import subprocess
    import sys

    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _records(6)))
    out = tmp_path / "w.json"
    run = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "bench", "workload", "--corpus", str(path),
                          "--stream", "documents", "--documents", "2", "--requests", "5", "--cold", "2", "--k", "2",
                          "--max-tokens", "2", "--model", str(tiny_llama_dir),
                          "--systems", "full,fusion+misses-first", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    for system in ("full", "fusion+misses-first"):
        rows = data["per_request"][system]
        assert len(rows) == 5 and all(r["prompt_tokens"] > 0 and "prefill_s" in r["stage_times"] for r in rows)
        m = data["systems"][system]
        assert m["warm_ttft_mean_s"] == pytest.approx(statistics.mean(r["ttft_s"] for r in rows[2:]))
        assert m["computed_fraction"] == pytest.approx(statistics.mean(r["computed"] for r in rows))
    assert all(r["computed"] == 1.0 for r in data["per_request"]["full"])
    assert any(r["computed"] < 1.0 for r in data["per_request"]["fusion+misses-first"][2:])


def test_bench_cluster_takes_the_retrieval_scope():
    from engine_sidecar.cli.main import build_parser

    assert build_parser().parse_args(["bench", "cluster"]).retrieval == "pooled"
    assert build_parser().parse_args(["bench", "cluster", "--retrieval", "per-document"]).retrieval == "per-document"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "cluster", "--retrieval", "nearby"])
