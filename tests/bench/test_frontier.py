"""The per-model frontier table: policies as rows, each shape's measures as columns, read from
`bench fidelity` reports (the summaries `policy_summary` writes)."""

from __future__ import annotations

import json

import pytest

from ragcache_lab.frontier import COLUMNS, frontier, frontier_table, main


def _summary(rouge: float, first: float, tf: float, f1_ratio: float | None, flips: tuple[int, int, int] | None,
             ttft: float) -> dict:
    out = {"rouge_l_vs_full": rouge, "first_token_agreement": first, "tf_agreement": tf, "f1_vs_full": f1_ratio,
           "ttft_ratio_vs_full": ttft}
    if flips is not None:
        out["flips"] = {"right_to_wrong": flips[0], "wrong_to_right": flips[1], "right_under_full": flips[2]}
    return out


FANOUT = {"config": {"n": 50}, "policies": {
    "full": _summary(1.0, 1.0, 1.0, 1.0, (0, 0, 25), 1.0),
    "reuse": _summary(0.457, 0.38, 0.801, 0.68, (16, 5, 25), 0.555)}}
SHORT = {"config": {"n": 30}, "policies": {
    "full": _summary(1.0, 1.0, 1.0, 1.0, (0, 0, 9), 1.0),
    "cacheblend:0.15:min24": _summary(0.674, 0.8, 0.899, 0.73, None, 0.275)}}


def test_rows_are_policies_and_each_shape_has_every_column():
    data = frontier("Qwen 0.5B", {"FanOutQA": FANOUT, "k=10 short": SHORT})
    lines = frontier_table(data).splitlines()
    assert lines[0] == "Qwen 0.5B (FanOutQA n=50, k=10 short n=30)"
    header = lines[2].strip("| ").split(" | ")
    assert header[0] == "policy" and len(header) == 1 + 2 * len(COLUMNS)
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ") for line in lines[4:] if
            line.startswith("| ")}
    assert list(rows) == ["full", "reuse", "cacheblend:0.15:min24"]
    reuse = rows["reuse"]
    assert reuse[1:7] == ["0.457", "0.38", "0.801", "68%", "16/5 of 25", "0.555x"]
    assert reuse[7:] == ["-"] * len(COLUMNS)  # not measured on the second shape
    blend = rows["cacheblend:0.15:min24"]
    assert blend[1:7] == ["-"] * len(COLUMNS)
    assert blend[7:] == ["0.674", "0.80", "0.899", "73%", "-", "0.275x"]  # no flips recorded


def test_the_command_reads_shape_named_reports_and_writes_json(tmp_path, capsys):
    fanout, short = tmp_path / "fq.json", tmp_path / "short.json"
    fanout.write_text(json.dumps(FANOUT))
    short.write_text(json.dumps(SHORT))
    out = tmp_path / "frontier.json"
    assert main(["--model", "m", f"FanOutQA={fanout}", f"k=10 short={short}", "--json", str(out)]) == 0
    assert "k=10 short ROUGE-L" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert list(written["shapes"]) == ["FanOutQA", "k=10 short"] and written["shapes"]["FanOutQA"]["n"] == 50


@pytest.mark.parametrize("arg", ["no-equals-sign.json", "shape=missing.json"])
def test_a_bad_argument_is_one_line_not_a_stack_trace(tmp_path, arg):
    with pytest.raises(SystemExit) as stop:
        main(["--model", "m", arg])
    assert "expected SHAPE=REPORT.json" in str(stop.value) or "cannot read" in str(stop.value)


def test_a_json_that_is_not_a_report_is_refused(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a `bench fidelity` report"):
        main(["--model", "m", f"s={other}"])
