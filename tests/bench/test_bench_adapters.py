"""The adapters benchmark's bookkeeping: ratios against the plain LLM and argument errors."""

from __future__ import annotations

import pytest

from ragcache_lab.adapters import SystemLog, adapter_summary, main


def test_summary_ratios_are_against_the_first_system():
    plain = SystemLog(ttft=[4.0, 2.0], followup_ttft=[2.0], hits=[0, 0], reused=[0, 0], answers=["a b", "c d"])
    cached = SystemLog(ttft=[2.0, 1.0], followup_ttft=[0.5], hits=[0, 2], reused=[0, 100], answers=["a b", "x y"])
    out = adapter_summary({"plain": plain, "cached": cached})
    assert out["plain"]["speedup_vs_plain"] == 1.0
    assert out["cached"]["speedup_vs_plain"] == pytest.approx(3.0 / 1.5)
    assert out["cached"]["followup_speedup_vs_plain"] == pytest.approx(4.0)
    assert out["cached"]["mean_chunk_hits"] == 1.0 and out["cached"]["mean_tokens_reused"] == 50
    assert out["cached"]["rouge_l_vs_plain"] == pytest.approx(0.5)


@pytest.mark.parametrize("argv, message", [(["--data", "/no/such.json"], "no such file"),
                                           (["--n", "0"], "at least 1")])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path):
    data = tmp_path / "qa.json"
    data.write_text('[{"question": "q", "ctxs": [{"text": "t"}]}]')
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(data), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
