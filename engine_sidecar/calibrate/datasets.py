"""QA sets for calibration and the benchmarks, in musique_s.json's shape ({question, answers,
ctxs: [{title, text}]}).

- `musique`: ../shared/data/musique_s.json (CacheBlend's MuSiQue sample), read as is.
- `fanoutqa`: assembled from the FanOutQA dev set that the `fanoutqa` wheel ships
  (fanoutqa/data/fanout-final-dev.json; installed with --no-deps, only the file is read). Each
  FanOutQA question fans out into sub-questions about sibling entities ("What is X's birth
  date?" for each nominee). Every sub-question with a single-string answer becomes a record whose
  passages are the fact statements of all its siblings, so the right passage sits among near
  duplicates, at a position that rotates over the first four from record to record. Consecutive records
share their passages in other orders, which is the reuse a chunk cache sees in practice.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from engine_sidecar.errors import InvalidPromptError

FANOUTQA_FILE = "data/fanout-final-dev.json"


def fanoutqa_path() -> Path:
    """The dev-set file inside the installed `fanoutqa` package, found without importing it
    (its import pulls spaCy, which the benchmark does not need)."""
    spec = importlib.util.find_spec("fanoutqa")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidPromptError("the fanoutqa package is not installed: pip install --no-deps fanoutqa==1.1.1")
    path = Path(list(spec.submodule_search_locations)[0]) / FANOUTQA_FILE
    if not path.is_file():
        raise InvalidPromptError(f"{path} is missing from the installed fanoutqa package")
    return path


def fact_text(sub: dict[str, Any]) -> tuple[str, str]:
    title = (sub.get("evidence") or {}).get("title") or ""
    question = sub["question"].strip()
    return title, f"{question} {sub['answer'].strip()}."


def fanoutqa_records(path: Path | None = None, min_siblings: int = 3) -> list[dict[str, Any]]:
    data = json.loads((path or fanoutqa_path()).read_text(encoding="utf-8"))
    records: list[dict[str, Any]] = []
    for top in data:
        leaves = [s for s in top.get("decomposition", [])
                  if isinstance(s.get("answer"), str) and s["answer"].strip() and not s.get("decomposition")]
        if len(leaves) < min_siblings:
            continue
        facts = [fact_text(s) for s in leaves]
        for i, sub in enumerate(leaves):
            # the answer's passage rotates over the first four positions (inside the default k=4);
            # siblings fill the rest in order
            others = [f for j, f in enumerate(facts) if j != i]
            at = (len(records) + 1) % min(len(facts), 4)
            ordered = others[:at] + [facts[i]] + others[at:]
            records.append({"question": sub["question"].strip(), "answers": [sub["answer"].strip()],
                            "ctxs": [{"title": t, "text": x} for t, x in ordered], "source": f"fanoutqa:{top['id']}"})
    return records


def load_records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(data, list) or not all(isinstance(r, dict) and "question" in r and "ctxs" in r for r in data):
        raise InvalidPromptError(f"{path}: expected records with 'question', 'answers' and 'ctxs'")
    return data


def chunk_texts(record: dict[str, Any], k: int) -> list[str]:
    return [f"{c.get('title', '')}\n{c['text']}".strip() for c in record["ctxs"][:k]]


def load_dataset(spec: str | Path) -> list[dict[str, Any]]:
    """A file path (musique_s.json format, JSON or JSONL), or `fanoutqa`."""
    if str(spec) == "fanoutqa":
        return fanoutqa_records()
    path = Path(spec)
    if not path.is_file():
        raise InvalidPromptError(f"{path}: no such file (give a musique_s.json-format file, or 'fanoutqa')")
    return load_records(path)
