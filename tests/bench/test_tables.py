"""The lab's one Markdown table layout, and a benchmark table built on it."""

from __future__ import annotations

from ragcache_lab.prefill import prefill_table
from ragcache_lab.tables import markdown_table


def test_markdown_table_lays_out_header_rule_and_rows():
    assert markdown_table(["a", "b"], [["1", "2"], ["3", ""]]) == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 |  |"
    assert markdown_table(["only"], []) == "| only |\n|---|"


def test_a_benchmark_table_is_its_cells_in_the_shared_layout():
    row = {"dtype": "float32", "tokens": 512, "system": "engine", "ms_per_token": 0.5, "server_ms_per_token": None,
           "ratio_vs_vllm": 1.25}
    table = prefill_table([row], ["a note"]).splitlines()
    assert table[0].startswith("| dtype | tokens | system |") and table[1] == "|" + "---|" * 9
    assert table[2] == "| float32 | 512 | engine | 0.500 | - | 1.25x | - | - | - |"
    assert table[-1] == "- a note"
