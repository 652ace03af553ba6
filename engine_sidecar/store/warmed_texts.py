"""The texts `ragcache warm` computed into a disk tier, kept beside their KV.

A sidecar later serving that folder reads them into its passage memory, so a plain OpenAI chat
that quotes a passage warmed offline finds it (the KV alone cannot say which text it belongs
to). One JSON line per passage; the newest `limit` are read, malformed lines skipped."""

from __future__ import annotations

import json
import logging
from collections import deque
from pathlib import Path

log = logging.getLogger("ragcache.store")

FILE_NAME = "warmed-passages.jsonl"


def record(folder: Path, texts: list[str], tenant: str = "") -> None:
    """Append the warmed texts; a folder that cannot be written only loses the plain-chat match."""
    try:
        with (Path(folder) / FILE_NAME).open("a", encoding="utf-8") as out:
            for text in texts:
                if text.strip():
                    out.write(json.dumps({"tenant": tenant, "text": text}, ensure_ascii=False) + "\n")
    except OSError as exc:
        log.warning("could not record the warmed passages' texts in %s: %s", folder, exc)


def read(folder: Path, limit: int) -> list[tuple[str, str]]:
    """(tenant, text) of the newest `limit` passages recorded in `folder`, oldest first."""
    path = Path(folder) / FILE_NAME
    if limit <= 0 or not path.is_file():
        return []
    newest: deque[tuple[str, str]] = deque(maxlen=limit)
    try:
        with path.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                try:
                    item = json.loads(line)
                    newest.append((str(item["tenant"]), str(item["text"])))
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError as exc:
        log.warning("could not read the warmed passages' texts in %s: %s", folder, exc)
    return list(newest)
