"""Where a benchmark's results go: the JSON with every row, and the same table it printed as
Markdown beside it (`<name>.md`), so docs can quote what was measured."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console


def write_report(path: Path, payload: dict[str, Any], table: str) -> list[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    markdown = path.with_suffix(".md")
    markdown.write_text(table + "\n", encoding="utf-8")
    return [path, markdown]


def run_and_write(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]],
                  table: Callable[[dict[str, Any]], str]) -> int:
    """A side-by-side lab command's end: run it, print its table, write the JSON (with the flags)
    and the table to `args.json`."""
    report = run(args)
    text = table(report)
    print(text)
    write_report(args.json, {**report, "config": {k: str(v) for k, v in vars(args).items()}}, text)
    return 0


def args_config(args: argparse.Namespace) -> dict[str, Any]:
    """The command's flags as JSON-ready config (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}


def publish(console: Console, json_path: Path | None, payload: dict[str, Any], table: str) -> None:
    """Print the table; with --json, write it and the payload beside each other."""
    print(table)
    if json_path:
        written = write_report(json_path, payload, table)
        console.print("wrote " + ", ".join(str(p) for p in written))
