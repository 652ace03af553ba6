"""`ragcache bench fidelity`: every policy family side by side on the assembled FanOutQA set,
with the table, JSON and scatter plot it writes; and the dataset assembly itself."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from engine_sidecar.calibrate.datasets import fanoutqa_records, load_dataset
from engine_sidecar.errors import InvalidPromptError


def test_fanoutqa_records_hold_the_answer_passage_within_the_first_four():
    records = fanoutqa_records()
    assert len(records) > 500
    for record in records[:200]:
        texts = [c["text"] for c in record["ctxs"][:4]]
        answer = record["answers"][0]
        assert sum(record["question"] in t and t.endswith(answer + ".") for t in texts) == 1
    # consecutive records of one FanOutQA question share their passages in another order
    assert {c["text"] for c in records[0]["ctxs"]} == {c["text"] for c in records[1]["ctxs"]}
    assert [c["text"] for c in records[0]["ctxs"]] != [c["text"] for c in records[1]["ctxs"]]


def test_unknown_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidPromptError, match="no such file"):
        load_dataset(tmp_path / "missing.json")


def test_fidelity_bench_runs_every_policy_family_and_writes_table_json_and_plot(tiny_llama_dir, tmp_path):
    out = tmp_path / "fidelity.json"
    policies = "full,reuse,cacheblend:0.15:temp1,epic:4,cachetune:0.15,cachecraft:0.5"
    proc = subprocess.run(
        [sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", "--data", "fanoutqa", "--n", "3", "--k", "3",
         "--policies", policies, "--model", str(tiny_llama_dir), "--no-transformers", "--no-disk", "--chunk-kv", "precomputed",
         "--max-tokens", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert list(result["policies"]) == policies.split(",")
    assert result["policies"]["full"]["rouge_l_vs_full"] == 1.0
    for m in result["policies"].values():
        lo, hi = m["rouge_l_ci95"]
        assert lo <= m["rouge_l_vs_full"] <= hi
    assert result["policies"]["reuse"]["recompute_share"] == 0.0
    assert 0.0 < result["policies"]["cachetune:0.15"]["recompute_share"] < 0.5
    assert "| cachecraft:0.5 |" in out.with_suffix(".md").read_text()
    assert "right→wrong / wrong→right" in out.with_suffix(".md").read_text()
    for m in result["policies"].values():  # every answer judged against gold beside full prefill's
        assert m["flips"]["questions"] == 3 and m["flips"]["right_to_wrong"] <= m["flips"]["right_under_full"]
    assert result["policies"]["full"]["flips"]["right_to_wrong"] == 0
    # teacher-forced along full's answer: full agrees with itself, the others are compared with
    # cacheblend:0.15:temp1 (the default baseline) question by question
    full = result["policies"]["full"]
    assert full["tf_agreement"] == 1.0 and abs(full["tf_kl"]) < 1e-6
    for name, m in result["policies"].items():
        assert 0.0 <= m["tf_agreement"] <= 1.0 and m["tf_kl"] >= -1e-6
        if name != "cacheblend:0.15:temp1":
            delta = m["tf_agreement_delta"]
            assert delta["vs"] == "cacheblend:0.15:temp1" and delta["ci95"][0] <= delta["mean"] <= delta["ci95"][1]
    assert "Teacher-forced along full prefill's answer" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # where the time went, per generated policy: CacheBlend's full layers apart, reuse has none
    assert "Where the time to first token goes" in out.with_suffix(".md").read_text()
    stages = {name: m["stage_ms"] for name, m in result["policies"].items()}
    assert "prefill_dense_layers_s" in stages["cacheblend:0.15:temp1"]
    assert "prefill_dense_layers_s" not in stages["reuse"] and stages["reuse"]["prefill_sparse_layers_s"] > 0


def test_task_accuracy_counts_answers_flipped_against_gold_by_hand():
    from ragcache_lab.fidelity import policy_summary

    def row(full: str, ours: str, gold: str) -> dict:
        return {"answers": [gold], "policies": {
            "full": {"text": full, "first_token": 1, "ttft_s": 1.0, "computed_fraction": 1.0},
            "reuse": {"text": ours, "first_token": 1, "ttft_s": 0.1, "computed_fraction": 0.0}}}

    rows = [row("exeter college oxford", "university of oxford", "Exeter College, Oxford"),  # right -> wrong
            row("thomas nabbes", "thomas nabbes", "Thomas Nabbes"),  # right both
            row("anthony hopkins", "bryan fuller", "Bryan Fuller"),  # wrong -> right
            row("nobody", "no one", "Mads Mikkelsen")]  # wrong both
    summary = policy_summary(rows, ["full", "reuse"])
    assert summary["reuse"]["flips"] == {"right_to_wrong": 1, "wrong_to_right": 1, "right_under_full": 2,
                                         "questions": 4}
    assert summary["full"]["flips"]["right_to_wrong"] == 0 and summary["full"]["f1_vs_full"] == 1.0
    # mean F1, policy over full: oxford 1/3 vs 1 (one shared word of three), nabbes 1 vs 1, fuller 1 vs 0
    assert summary["reuse"]["f1_vs_full"] == pytest.approx((1 / 3 + 1 + 1) / (1 + 1))


def test_stage_medians_by_hand():
    from ragcache_lab.fidelity import stage_medians, stage_table

    entries = [{"stage_s": {"prefill_setup_s": 0.001, "prefill_dense_layers_s": 0.010}},
               {"stage_s": {"prefill_setup_s": 0.003}}, {"stage_s": {"prefill_setup_s": 0.002}}, {}]
    medians = stage_medians(entries)
    # a question whose request ran no dense layer counts 0 there; an entry without times is left out
    assert medians == pytest.approx({"prefill_setup_s": 2.0, "prefill_dense_layers_s": 0.0})
    table = stage_table({"a": {"stage_ms": medians}, "b": {"stage_ms": {}}})
    assert table[3] == "| policy | setup | dense layers |" and table[-1] == "| a | 2.0 | 0.0 |"
    assert stage_table({"a": {"stage_ms": {"plan_s": 1.0}}}) == []  # no prefill split (a GPU): no table


def test_bootstrap_interval_brackets_the_mean_and_is_reproducible():
    from ragcache_lab.metrics import bootstrap_ci

    values = [0.0, 1.0, 0.5, 0.25, 0.75, 1.0, 0.0, 0.5]
    lo, hi = bootstrap_ci(values)
    assert 0.0 <= lo < sum(values) / len(values) < hi <= 1.0
    assert bootstrap_ci(values) == (lo, hi)  # fixed seed
    assert bootstrap_ci([0.4] * 5) == (0.4, 0.4)
    narrow = bootstrap_ci(values * 20)
    assert narrow[1] - narrow[0] < hi - lo  # more questions, tighter interval


def run_bench(model_dir, out, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", "--data", "fanoutqa", "--k", "3",
         "--model", str(model_dir), "--no-transformers", "--no-disk", "--chunk-kv", "precomputed", "--max-tokens", "3", "--json", str(out), *extra],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_follow_up_mode_measures_turn_two_of_a_conversation(tiny_llama_dir, tmp_path):
    follow = run_bench(tiny_llama_dir, tmp_path / "follow.json", "--n", "3", "--follow-up",
                       "--policies", "full,cacheblend:0.15,cachecraft:0.5")
    single = run_bench(tiny_llama_dir, tmp_path / "single.json", "--n", "2", "--policies", "full")
    assert follow["config"]["follow_up"] is True and len(follow["rows"]) == 2
    records = fanoutqa_records()
    assert [r["question"] for r in follow["rows"]] == [records[1]["question"], records[2]["question"]]
    # turn 2 carries turn 1's history: its prompt is longer than the same question asked alone
    assert follow["rows"][0]["policies"]["full"]["prompt_tokens"] > single["rows"][1]["policies"]["full"]["prompt_tokens"]
    assert "turn 2 of a two-turn conversation" in (tmp_path / "follow.md").read_text()


def _row(i: int, generated: bool) -> dict:
    def entry(agreement: float, ttft: float, text: str | None) -> dict:
        return {"text": text, "first_token": [1], "token_ids": [1, 2], "ttft_s": ttft, "computed_fraction": ttft,
                "recompute_share": 0.0, "tf_agreement": agreement, "tf_kl": 1.0 - agreement}
    return {"index": i, "question": f"q{i}", "answers": ["a"], "policies": {
        "full": entry(1.0, 1.0, "the answer"),
        "reuse": entry(0.5 + 0.01 * i, 0.1, "the answer" if generated else None),
        "cacheblend:0.15:temp1": entry(0.6 + 0.01 * i, 0.25, "an answer" if generated else None),
        **({"focus:0.15": entry(0.7, 0.25, "x")} if generated else {})}}


def test_merge_partials_pools_runs_pairs_per_question_and_drops_text_of_mixed_runs(tmp_path):
    from ragcache_lab.fidelity import merge_partials

    first, second = tmp_path / "a.partial.jsonl", tmp_path / "b.partial.jsonl"
    first.write_text("".join(json.dumps(_row(i, True)) + "\n" for i in range(3)))
    second.write_text("".join(json.dumps(_row(i, False)) + "\n" for i in range(3, 6)) + "\n")
    out = tmp_path / "merged.json"
    table = merge_partials([first, second], out)
    report = json.loads(out.read_text())
    assert report["config"]["n"] == 6 and report["config"]["generated"] is False
    # focus:0.15 is missing from the second run's rows: left out
    assert list(report["policies"]) == ["full", "reuse", "cacheblend:0.15:temp1"]
    reuse = report["policies"]["reuse"]
    assert reuse["rouge_l_vs_full"] is None  # text of the generated rows dropped, not a 3-row ROUGE-L
    assert reuse["tf_agreement"] == pytest.approx(0.5 + 0.01 * 2.5)
    # paired per question: reuse is 0.1 below cacheblend on every row, so the interval is a point
    assert reuse["tf_agreement_delta"]["vs"] == "cacheblend:0.15:temp1"
    assert reuse["tf_agreement_delta"]["mean"] == pytest.approx(-0.1)
    assert reuse["tf_agreement_delta"]["ci95"] == pytest.approx([-0.1, -0.1])
    assert reuse["ttft_ratio_vs_full"] == pytest.approx(0.1)
    assert "6 questions" in table and "| reuse | - | - | - |" in table
    # all generated: ROUGE-L kept; a dropped policy leaves the table
    merge_partials([first], out, drop=("focus:0.15",))
    report = json.loads(out.read_text())
    assert list(report["policies"]) == ["full", "reuse", "cacheblend:0.15:temp1"]
    assert report["policies"]["reuse"]["rouge_l_vs_full"] == pytest.approx(1.0)
    empty = tmp_path / "empty.partial.jsonl"
    empty.write_text("")
    with pytest.raises(InvalidPromptError, match="no rows"):
        merge_partials([empty])


def test_neighbours_mode_warms_every_chunk_after_its_neighbours_and_pairs_with_a_precomputed_run(tiny_llama_dir,
                                                                                                 tmp_path):
    from ragcache_lab.paired_runs import main as pair_main

    args = ("--n", "3", "--k", "3", "--no-generate", "--policies", "full,reuse,cacheblend:0.15:temp1")
    nb = run_bench(tiny_llama_dir, tmp_path / "nb.json", *args, "--chunk-kv", "neighbours", "--neighbours", "1")
    pre = run_bench(tiny_llama_dir, tmp_path / "pre.json", *args)
    assert nb["config"]["chunk_kv"] == "neighbours" and nb["config"]["neighbours"] == 1
    assert "(1 neighbours)" in (tmp_path / "nb.md").read_text()
    # the same questions and full-prefill answers; only the reused KV differs
    assert [r["policies"]["full"]["token_ids"] for r in nb["rows"]] == [
        r["policies"]["full"]["token_ids"] for r in pre["rows"]]
    assert any(abs(a["policies"]["reuse"]["tf_kl"] - b["policies"]["reuse"]["tf_kl"]) > 1e-6
               for a, b in zip(nb["rows"], pre["rows"], strict=True))
    out = tmp_path / "paired.json"
    assert pair_main([str(out), f"pre={tmp_path / 'pre.json'}", f"nb={tmp_path / 'nb.json'}",
                      "--baseline", "cacheblend:0.15:temp1@pre"]) == 0
    paired = json.loads(out.read_text())
    assert paired["config"]["n"] == 3 and paired["config"]["left_out"] == 0
    assert set(paired["policies"]) == {"full", "reuse@pre", "cacheblend:0.15:temp1@pre", "reuse@nb",
                                       "cacheblend:0.15:temp1@nb"}
    delta = paired["policies"]["reuse@nb"]["tf_agreement_delta"]
    diffs = [a["policies"]["reuse"]["tf_agreement"] - b["policies"]["cacheblend:0.15:temp1"]["tf_agreement"]
             for a, b in zip(nb["rows"], pre["rows"], strict=True)]
    assert delta["vs"] == "cacheblend:0.15:temp1@pre" and delta["mean"] == pytest.approx(sum(diffs) / 3)
    # TTFT against the full prefill timed in the same run
    for label, run in (("nb", nb), ("pre", pre)):
        own = statistics.median(r["policies"]["full"]["ttft_s"] for r in run["rows"])
        reuse = statistics.median(r["policies"]["reuse"]["ttft_s"] for r in run["rows"])
        assert paired["policies"][f"reuse@{label}"]["ttft_ratio_vs_full"] == pytest.approx(reuse / own)
    assert pair_main([str(out), f"pre={tmp_path / 'pre.json'}", "--baseline", "x@pre"]) == 2  # one run only
    assert pair_main([str(out), f"pre={tmp_path / 'pre.json'}", f"nb={tmp_path / 'nb.json'}",
                      "--baseline", "nothing@pre"]) == 2


def test_start_measures_a_split_apart_from_the_first_records(tiny_llama_dir, tmp_path):
    records = fanoutqa_records()
    split = run_bench(tiny_llama_dir, tmp_path / "split.json", "--start", "5", "--n", "2", "--no-generate",
                      "--policies", "full,reuse")
    assert [r["question"] for r in split["rows"]] == [records[5]["question"], records[6]["question"]]
    assert [r["index"] for r in split["rows"]] == [5, 6] and split["config"]["start"] == 5
    assert "2 questions from record 5" in (tmp_path / "split.md").read_text()
    for bad, message in ((("--start", "-1"), "--start at least 0"), (("--start", "100000"), "no records from index")):
        proc = subprocess.run(
            [sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", "--data", "fanoutqa", "--n", "2",
             "--model", str(tiny_llama_dir), "--no-transformers", "--no-disk", *bad],
            capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_several_chunk_kv_modes_run_in_one_command_and_are_paired(tiny_llama_dir, tmp_path):
    out = tmp_path / "both.json"
    paired = run_bench(tiny_llama_dir, out, "--n", "3", "--no-generate", "--policies", "full,reuse,cacheblend",
                       "--chunk-kv", "precomputed,neighbours", "--neighbours", "1", "--baseline", "reuse")
    runs = {mode: json.loads((tmp_path / f"both-{mode}.json").read_text()) for mode in ("precomputed", "neighbours")}
    assert runs["precomputed"]["config"]["chunk_kv"] == "precomputed"
    assert runs["neighbours"]["config"]["chunk_kv"] == "neighbours" and runs["neighbours"]["config"]["neighbours"] == 1
    assert list(paired["policies"]) == ["full", "reuse@precomputed", "cacheblend@precomputed", "reuse@neighbours",
                                        "cacheblend@neighbours"]
    assert paired["config"]["data"] == "fanoutqa" and paired["config"]["k"] == 3 and paired["config"]["n"] == 3
    # each paired value is the one its own run measured, and deltas pair against reuse on the first mode
    for mode, run in runs.items():
        for row, own in zip(paired["rows"], run["rows"], strict=True):
            assert row["policies"][f"cacheblend@{mode}"]["tf_agreement"] == own["policies"]["cacheblend"]["tf_agreement"]
    diffs = [r["policies"]["cacheblend@neighbours"]["tf_agreement"] - r["policies"]["reuse@precomputed"]["tf_agreement"]
             for r in paired["rows"]]
    delta = paired["policies"]["cacheblend@neighbours"]["tf_agreement_delta"]
    assert delta["vs"] == "reuse@precomputed" and delta["mean"] == pytest.approx(sum(diffs) / 3)
    assert "cacheblend@neighbours" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").is_file()
    for bad, message in ((("--chunk-kv", "precomputed,alone"), "give one or more of"),
                         (("--chunk-kv", "neighbours,neighbours"), "named twice"),
                         (("--chunk-kv", "precomputed,neighbours", "--baseline", "reuse@in-context"),
                          "not one of --chunk-kv")):
        proc = subprocess.run(
            [sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", "--data", "fanoutqa", "--n", "2",
             "--policies", "full,reuse", "--model", str(tiny_llama_dir), "--no-transformers", "--no-disk", *bad],
            capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_each_chunk_kv_mode_reads_only_the_kv_it_made_itself(tiny_llama_dir, tmp_path):
    """With the disk tier on, the precomputed run after a neighbours run must not be served the
    neighbour-warmed entries the first run left on disk, nor anything from the user's cache."""
    home = tmp_path / "home"
    out = tmp_path / "modes.json"
    proc = subprocess.run(
        [sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", "--data", "fanoutqa", "--k", "3", "--n", "3",
         "--model", str(tiny_llama_dir), "--no-transformers", "--max-tokens", "3", "--no-generate",
         "--policies", "full,reuse", "--chunk-kv", "neighbours,precomputed", "--neighbours", "1",
         "--baseline", "reuse@neighbours", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "RAGCACHE_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    runs = {mode: json.loads((tmp_path / f"modes-{mode}.json").read_text()) for mode in ("neighbours", "precomputed")}
    kl = {mode: [row["policies"]["reuse"]["tf_kl"] for row in run["rows"]] for mode, run in runs.items()}
    # KV computed alone and KV warmed after a neighbour give other logits for every question
    assert all(a != b for a, b in zip(kl["neighbours"], kl["precomputed"], strict=True)), kl
    # the runs stored into folders of their own, removed afterwards
    assert [p for p in home.rglob("*") if p.is_file() and "kv" in p.parts] == []


def _fidelity(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "bench", "fidelity", *argv],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})


def test_a_model_axis_runs_the_same_questions_through_each_model(tiny_llama_dir, smol_dir, tmp_path):
    from tests.conftest import make_family_model

    qwen3 = make_family_model(tmp_path / "tiny-qwen3", "qwen3", tokenizer_from=smol_dir)
    out = tmp_path / "models.json"
    proc = _fidelity("--data", "fanoutqa", "--n", "2", "--k", "3", "--max-tokens", "3", "--policies", "full,reuse",
                     "--models", f"{tiny_llama_dir},{qwen3}", "--no-transformers", "--no-disk", "--chunk-kv",
                     "precomputed", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    combined = json.loads(out.read_text())["models"]
    assert list(combined) == [str(tiny_llama_dir), str(qwen3)]
    for model, label in ((tiny_llama_dir, tiny_llama_dir.name), (qwen3, "tiny-qwen3")):
        own = json.loads((tmp_path / f"models-{label}.json").read_text())  # each model's own full report
        assert own["config"]["model"] == str(model) and own["config"]["n"] == 2
        (run,) = combined[str(model)]
        assert run["chunk_kv"] == "precomputed" and run["policies"] == own["policies"]
        assert run["policies"]["full"]["rouge_l_vs_full"] == 1.0 and "flips" in run["policies"]["reuse"]
    # the same questions: both models answered the same records
    questions = [[r["question"] for r in json.loads((tmp_path / f"models-{label}.json").read_text())["rows"]]
                 for label in (tiny_llama_dir.name, "tiny-qwen3")]
    assert questions[0] == questions[1]
    table = out.with_suffix(".md").read_text()
    assert table.count(f"| {qwen3} | precomputed | 2 |") == 2 and table.count(f"| {tiny_llama_dir} |") == 2


def test_a_model_axis_checks_every_model_before_the_first_run(tiny_llama_dir, tmp_path):
    proc = _fidelity("--data", "fanoutqa", "--n", "2", "--models", f"{tiny_llama_dir},{tmp_path / 'missing'}",
                     "--no-disk", "--json", str(tmp_path / "m.json"))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "does not exist" in lines[0], proc.stderr
    assert not list(tmp_path.glob("m*.json"))  # nothing ran


def test_cache_craft_variants_are_recorded_in_the_context_asked_for():
    from ragcache_lab.fidelity import craft_prompt

    record = {"question": "own?", "ctxs": [{"title": f"T{i}", "text": f"own {i}"} for i in range(3)]}
    foreign = {"question": "other?", "ctxs": [{"title": f"F{i}", "text": f"other {i}"} for i in range(2)]}
    rotated = craft_prompt(record, 3)
    assert rotated.question == "own?"
    assert [c.text for c in rotated.chunks] == ["T2\nown 2", "T0\nown 0", "T1\nown 1"]
    mixed = craft_prompt(record, 3, foreign)
    assert mixed.question == "other?"
    assert [c.text for c in mixed.chunks] == ["F0\nother 0", "T0\nown 0", "F1\nother 1", "T1\nown 1",
                                               "T2\nown 2"]


def test_foreign_craft_context_runs_and_is_recorded(tiny_llama_dir, tmp_path):
    report = run_bench(tiny_llama_dir, tmp_path / "craft.json", "--n", "2", "--policies", "full,cachecraft:1",
                       "--craft-context", "foreign", "--no-generate")
    assert report["config"]["craft_context"] == "foreign" and len(report["rows"]) == 2
    assert all("cachecraft:1" in row["policies"] for row in report["rows"])
