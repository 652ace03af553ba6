"""The benchmark pages stay usable: docs/benchmarks.md is a results page short enough to read (the
experiments behind it live in notes/benchmarks-lab.md), the section names that code comments and
other pages cite by name still exist, their links resolve, and the lab notes never ship in the
wheel."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "benchmarks.md"
LAB_NOTES = ROOT / "notes" / "benchmarks-lab.md"
MAX_RESULTS_LINES = 600

# Cited by name from code comments, the Makefile and other docs ("docs/benchmarks.md, <name>").
CITED_SECTIONS = (
    "Prefill speed",
    "Warming after neighbours",
    "Many short passages per question",
    "Short contexts",
    "Real models",
    "n=100 on both sets",
    "`mix`",
    "Replicas on Ray Serve",
    "All fusion policies side by side",
)

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _headings(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")]


def test_results_page_stays_short() -> None:
    lines = len(RESULTS.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_RESULTS_LINES, (
        f"docs/benchmarks.md has {lines} lines (at most {MAX_RESULTS_LINES}): keep the current result of "
        "each benchmark there and move how it was reached to notes/benchmarks-lab.md")


def test_cited_sections_exist() -> None:
    headings = _headings(RESULTS)
    missing = [name for name in CITED_SECTIONS if not any(name in heading for heading in headings)]
    assert not missing, f"sections cited by name are gone from docs/benchmarks.md: {missing}"


def test_relative_links_resolve() -> None:
    broken = []
    for page in (RESULTS, LAB_NOTES):
        for target in _relative_links(page):
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve()
            if not linked.is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in {_anchor(h) for h in _headings(linked)}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, f"links to nothing: {broken}"


def test_anchors_into_the_results_page_exist() -> None:
    anchors = {_anchor(heading) for heading in _headings(RESULTS)}
    broken = []
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for target in _relative_links(page):
            file_part, _, anchor = target.partition("#")
            if anchor and (page.parent / file_part).resolve() == RESULTS and anchor not in anchors:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"anchors into docs/benchmarks.md that no heading has: {broken}"


def test_lab_notes_are_not_packaged() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    packages = config["tool"]["setuptools"]["packages"]
    assert not [name for name in packages if name == "notes" or name.startswith("notes.")]
    assert not (ROOT / "notes" / "__init__.py").exists()
