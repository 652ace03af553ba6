"""The Engine owns the model runner, the scheduler and the reuse cache: no module outside
`engine_sidecar/engine/` (and the tests) reads or writes an Engine attribute beyond the
engine's declared public API (`engine.PUBLIC_API`). A tool that needs something the API does
not give asks for a new method there, so what the engine wires inside stays free to change.

Which expressions are an Engine is a naming heuristic, since the code is untyped in places:
a name `engine` or `_engine`, an attribute of that name (`self.engine`, `backend._engine`), and
a call of a function so named (`self._worker_engine()`). `getattr(engine, "name")` and
`hasattr`/`setattr` with a literal name count as reads too."""

from __future__ import annotations

import ast
from pathlib import Path

from engine_sidecar.engine.engine import PUBLIC_API, Engine

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("engine_sidecar", "ragcache_integrations", "ragcache_lab", "examples", "kernels")
INSIDE = "engine_sidecar/engine/"
# third-party names that end in "engine" and are not ours (LlamaIndex's query engines)
NOT_ENGINES = frozenset({"query_engine", "as_query_engine"})

# path -> why it may still reach past the API. An entry must still have such reads: a file moved
# onto the API leaves the list.
ALLOWED: dict[str, str] = {}


def _is_engine_name(name: str) -> bool:
    return name not in NOT_ENGINES and (name.lstrip("_") == "engine" or name.endswith("_engine"))


def _is_engine(node: ast.expr) -> bool:
    """Whether an expression is, by its name, an Engine."""
    if isinstance(node, ast.Name):
        return node.id.lstrip("_") == "engine"
    if isinstance(node, ast.Attribute):
        return node.attr.lstrip("_") == "engine"
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return _is_engine_name(name)
    return False


def engine_reads(source: str) -> list[tuple[int, str]]:
    """(line, attribute) for every attribute of an Engine the source touches, by the heuristic
    above: `engine.x`, `self.engine.x`, `make_engine().x`, `getattr(engine, "x")`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_engine(node.value):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and _is_engine(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            found.append((node.lineno, node.args[1].value))
    return sorted(found)


def is_public(attr: str) -> bool:
    return attr in PUBLIC_API or (attr.startswith("__") and attr.endswith("__"))


def outside_modules() -> list[Path]:
    return [path for folder in SOURCE_DIRS for path in sorted((ROOT / folder).rglob("*.py"))
            if not path.relative_to(ROOT).as_posix().startswith(INSIDE)]


def reads_past_the_api() -> dict[str, list[str]]:
    """path -> 'path:line: engine.attr' for each read of a non-API attribute."""
    out: dict[str, list[str]] = {}
    for path in outside_modules():
        rel = path.relative_to(ROOT).as_posix()
        bad = [f"{rel}:{line}: engine.{attr}" for line, attr in engine_reads(path.read_text(encoding="utf-8"))
               if not is_public(attr)]
        if bad:
            out[rel] = bad
    return out


def test_the_heuristic_finds_engine_reads_and_lets_others_through():
    source = ("engine.store.stats()\nself.engine.runner.device\nself._worker_engine().split.prefix()\n"
              "getattr(self.engine, 'model_dir', None)\nengine.generate(p)\nengine.scheduler = None\n"
              "query_engine.query(q)\nindex.as_query_engine(llm=x).query(q)\nother.store\nengines.items()\n")
    assert engine_reads(source) == [(1, "store"), (2, "runner"), (3, "split"), (4, "model_dir"),
                                    (5, "generate"), (6, "scheduler")]


def test_the_walk_sees_the_tools():
    names = {path.relative_to(ROOT).as_posix() for path in outside_modules()}
    assert {"engine_sidecar/server/backend.py", "engine_sidecar/cli/main.py", "ragcache_lab/gpu.py"} <= names
    assert not any(name.startswith(INSIDE) for name in names)


def test_the_public_api_exists_on_the_engine():
    missing = sorted(name for name in PUBLIC_API if not hasattr(Engine, name))
    assert not missing, f"PUBLIC_API names what Engine does not define: {missing}"
    private = sorted(name for name in PUBLIC_API if name.startswith("_"))
    assert not private, f"PUBLIC_API names private attributes: {private}"


def test_no_module_outside_the_engine_reads_past_its_api():
    offenders = [line for path, lines in reads_past_the_api().items() if path not in ALLOWED for line in lines]
    assert offenders == [], (
        f"{len(offenders)} reads of Engine attributes outside its public API (engine.PUBLIC_API); use an "
        "API method, or add one to the Engine that returns plain data:\n" + "\n".join(offenders))


def test_every_allowed_exception_is_still_needed():
    found = reads_past_the_api()
    stale = sorted(path for path in ALLOWED if path not in found)
    assert not stale, f"these files no longer read past the Engine's API, remove them from ALLOWED: {stale}"
