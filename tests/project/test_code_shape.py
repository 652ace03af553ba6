"""The shape of the code itself: no function longer than a screenful or two (a long one mixes
concerns and hides its data flow), and no references to tracker numbers in code, tests or docs
(they rot; say what the thing does and why instead)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("engine_sidecar", "ragcache_integrations", "kernels", "examples", "ragcache_lab")
MAX_LINES = 80

# "path::qualname" -> why it may stay longer than MAX_LINES. An entry must still be too long:
# a split function leaves the list.
ALLOWED_LONG: dict[str, str] = {
    "engine_sidecar/cli/main.py::build_parser": "an argument table",
}

# Built from parts so that this file does not match its own pattern.
TRACKER_REFERENCE = re.compile(r"(?i)\b" + "issue" + r"\s*#?\d+")
TEXT_ROOTS = (*SOURCE_DIRS, "tests", "docs", "README.md")


def _functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method with its qualname (`Class.method`, `outer.<locals>.inner`)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            qualname = prefix + node.name
            yield qualname, node
            yield from _functions(node, f"{qualname}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def function_lengths() -> dict[str, int]:
    """'path::qualname' -> lines of the def (decorators excluded, as `ast` counts them)."""
    lengths: dict[str, int] = {}
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            for qualname, node in _functions(tree):
                assert node.end_lineno is not None
                lengths[f"{rel}::{qualname}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_the_walk_sees_the_code():
    lengths = function_lengths()
    assert "engine_sidecar/reuse/planner.py::Planner.plan" in lengths
    assert len(lengths) > 500


def test_no_function_is_longer_than_the_limit():
    too_long = {
        name: n for name, n in function_lengths().items() if n > MAX_LINES and name not in ALLOWED_LONG
    }
    assert not too_long, (
        f"functions longer than {MAX_LINES} lines; split them into helpers with one concern each: "
        + ", ".join(f"{name} ({n})" for name, n in sorted(too_long.items()))
    )


def test_every_allowed_long_function_is_still_long():
    lengths = function_lengths()
    missing = sorted(name for name in ALLOWED_LONG if name not in lengths)
    assert not missing, (
        f"ALLOWED_LONG names functions that no longer exist (renamed or moved?): {', '.join(missing)}; "
        "update or remove their entries"
    )
    short = sorted(f"{name} ({lengths[name]})" for name in ALLOWED_LONG if lengths[name] <= MAX_LINES)
    assert not short, f"now {MAX_LINES} lines or fewer, remove from ALLOWED_LONG: {', '.join(short)}"


def _text_files() -> Iterator[Path]:
    for name in TEXT_ROOTS:
        root = ROOT / name
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in paths:
            # tool caches (__pycache__, .pytest_cache, ...) are not ours to word
            if any(part == "__pycache__" or part.startswith(".") for part in path.relative_to(ROOT).parts):
                continue
            yield path


def test_the_pattern_finds_tracker_references():
    number = "1" + "5"
    for text in (f"issue {number}", f"Issue #{number}", f"(issue{number})", f"ISSUE  {number}"):
        assert TRACKER_REFERENCE.search(text), text
    for text in ("issues", f"tissue {number}", f"an issue with {number} chunks", f"issue_{number}"):
        assert not TRACKER_REFERENCE.search(text), text


def test_no_tracker_references_in_code_tests_or_docs():
    found = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # images and other binaries
        for match in TRACKER_REFERENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT).as_posix()}:{line}: {match.group()!r}")
    advice = "say what the code does and why, not which tracker entry asked for it"
    assert not found, advice + ":\n" + "\n".join(found)


# Test folders: the package or stage each one's tests are about, mirroring the source tree.
TEST_FOLDERS = {"engine", "reuse", "execution", "request", "store", "model", "server", "vllm_backend", "cluster",
                "bench", "cli", "config", "kernels", "integrations", "examples", "properties", "project"}


def test_tests_mirror_the_packages():
    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == []  # none left at the top
    folders = {p.parent.relative_to(tests).parts[0] for p in tests.rglob("test_*.py")}
    assert folders <= TEST_FOLDERS, folders - TEST_FOLDERS
    sources = {p.name for p in (ROOT / "engine_sidecar").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    # bench: the benchmark lab's tests (ragcache_lab/, beside engine_sidecar/)
    assert (TEST_FOLDERS - sources) == {"bench", "config", "kernels", "integrations", "examples", "properties",
                                        "project"}
