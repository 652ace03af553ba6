"""The benchmarks' Markdown tables: one way to lay out a header and its rows. Each benchmark
builds its own cells (what it reports and how it formats numbers) and hands them here."""

from __future__ import annotations


def table_row(cells: list[str]) -> str:
    """`| a | b |` (an empty cell keeps its two spaces: `| a |  |`)."""
    return "| " + " | ".join(cells) + " |"


def table_lines(header: list[str], rows: list[list[str]]) -> list[str]:
    """The header, its `|---|` rule and one line per row."""
    return [table_row(header), "|" + "---|" * len(header), *(table_row(row) for row in rows)]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(table_lines(header, rows))
