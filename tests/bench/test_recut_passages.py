"""Re-cutting a set's passages into many short ones (`bench fidelity --passage-words`): whole
sentences in order, no text lost, titles kept, and the fidelity run really asks the short ones."""

from __future__ import annotations

import json

import pytest

from engine_sidecar.cli.main import build_parser
from engine_sidecar.errors import InvalidPromptError
from ragcache_lab.fidelity import plan_run
from ragcache_lab.recut import recut_records, recut_text


def long_passage_records(path, n: int = 3) -> list[dict]:
    """Records shaped as MuSiQue's: a few passages of 440 words each, 40 sentences of 11 words."""
    records = [{"question": f"question {i}?", "answers": [f"answer {i}"],
                "ctxs": [{"title": f"page {i}.{j}",
                          "text": " ".join(f"sentence {s} of passage {j} in record {i} has eleven words." for s in range(40))}
                         for j in range(4)]} for i in range(n)]
    path.write_text(json.dumps(records))
    return records


def test_sentences_are_grouped_until_a_passage_holds_enough_words():
    text = "One two three. Four five! Six seven eight nine? Ten. Eleven twelve thirteen fourteen."
    # 3 words, then 2 (5 >= 4: closed), then 4 (closed), then 1 + 4 = 5
    assert recut_text(text, 4) == ["One two three. Four five!", "Six seven eight nine?",
                                   "Ten. Eleven twelve thirteen fourteen."]


def test_a_short_tail_joins_the_passage_before_it():
    assert recut_text("a b c d. e f g h. i.", 4) == ["a b c d.", "e f g h. i."]
    assert recut_text("a b c d. e f.", 4) == ["a b c d.", "e f."]  # half of 4 words stands alone
    assert recut_text("a b c d e f g.", 4) == ["a b c d e f g."]  # one long sentence stays whole


def test_records_keep_every_word_in_order_with_numbered_titles():
    record = {"question": "q?", "answers": ["x"],
              "ctxs": [{"title": "T", "text": "a b c. d e f. g h i."}, {"title": "U", "text": "j k."}]}
    (out,) = recut_records([record], 3)
    assert [c["title"] for c in out["ctxs"]] == ["T (1)", "T (2)", "T (3)", "U"]
    assert " ".join(c["text"] for c in out["ctxs"]) == "a b c. d e f. g h i. j k."
    assert out["question"] == "q?" and out["answers"] == ["x"] and record["ctxs"][0]["text"] == "a b c. d e f. g h i."
    with pytest.raises(InvalidPromptError, match="--passage-words"):
        recut_records([record], 0)


def test_long_passages_become_ten_short_ones_per_question(tmp_path):
    records = recut_records(long_passage_records(tmp_path / "set.json"), 70)
    for record in records:
        assert len(record["ctxs"]) == 4 * 6  # 40 sentences of 11 words: five pieces of 7, a tail of 5
        assert {len(c["text"].split()) for c in record["ctxs"]} == {77, 55}


def test_the_fidelity_run_measures_the_re_cut_passages(tmp_path):
    data = tmp_path / "set.json"
    original = long_passage_records(data)
    args = build_parser().parse_args(["bench", "fidelity", "--data", str(data), "--n", "2", "--k", "10",
                                      "--passage-words", "70", "--json", str(tmp_path / "r.json")])
    plan = plan_run(args)
    assert len(plan.records) == 2
    for record, source in zip(plan.records, original[:2], strict=True):
        assert len(record["ctxs"]) == 24
        assert record["ctxs"][0]["text"] == recut_text(source["ctxs"][0]["text"], 70)[0]
    plain = plan_run(build_parser().parse_args(["bench", "fidelity", "--data", str(data), "--n", "2"]))
    assert plain.records == original[:2]
