"""Re-cut a QA set's passages into short sentence-aligned ones, so one set's questions can be asked
with many short passages per question (HotpotQA's shape) as well as a few long ones
(`bench fidelity --passage-words`)."""

from __future__ import annotations

import re
from typing import Any

from engine_sidecar.errors import InvalidPromptError

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def recut_text(text: str, words: int) -> list[str]:
    """`text` as consecutive passages of whole sentences, each closed once it holds at least
    `words` words; a last piece shorter than half of that joins the passage before it."""
    pieces: list[list[str]] = []
    count = 0
    for sentence in (s for s in SENTENCE_END.split(text.strip()) if s):
        if not pieces or count >= words:
            pieces.append([])
            count = 0
        pieces[-1].append(sentence)
        count += len(sentence.split())
    if len(pieces) > 1 and count < words / 2:
        pieces[-2].extend(pieces.pop())
    return [" ".join(p) for p in pieces]


def recut_records(records: list[dict[str, Any]], words: int) -> list[dict[str, Any]]:
    """Each record with its passages, in order, re-cut into passages of about `words` words; each
    piece keeps its passage's title, numbered when a passage gives several."""
    if words < 1:
        raise InvalidPromptError("--passage-words must be at least 1")
    out = []
    for record in records:
        ctxs = []
        for ctx in record["ctxs"]:
            parts = recut_text(ctx["text"], words)
            title = ctx.get("title", "")
            ctxs += [{"title": f"{title} ({j + 1})" if title and len(parts) > 1 else title, "text": part}
                     for j, part in enumerate(parts)]
        out.append({**record, "ctxs": ctxs})
    return out
