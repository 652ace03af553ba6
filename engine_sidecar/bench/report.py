"""Where a benchmark's results go: the JSON with every row, and the same table it printed as
Markdown beside it (`<name>.md`), so docs can quote what was measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(path: Path, payload: dict[str, Any], table: str) -> list[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    markdown = path.with_suffix(".md")
    markdown.write_text(table + "\n", encoding="utf-8")
    return [path, markdown]
