"""The tools layer imports only downward: `cli/` wires commands and imports the calibration and the
demo, so nothing imports the CLI back, the benchmark lab (ragcache_lab/) included: the shared
engine flags live in `engine_args.py`. The lab's modules, the calibration's and the CLI's form no
cycle among themselves. Imports inside functions count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "engine_sidecar"
LAB = ROOT / "ragcache_lab"


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports_of(path: Path, known: set[str]) -> set[str]:
    """First-party modules `path` imports anywhere in its body (a `from m import name` that names a
    submodule counts as that submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    found.discard(module_name(path))
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for folder in (PACKAGE, LAB) for p in folder.rglob("*.py")}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def test_nothing_imports_the_cli():
    # but the console script's launcher, which runs it and turns a missing extra into one line
    importers = sorted(name for name, deps in graph().items() if "engine_sidecar.cli.main" in deps)
    assert importers == ["engine_sidecar.cli.__main__", "engine_sidecar.cli.entry"], \
        f"{importers} import engine_sidecar.cli.main: import engine_sidecar.engine_args instead"


def test_tools_modules_form_no_cycle():
    edges = graph()
    tools = {n for n in edges if n.startswith(("ragcache_lab", "engine_sidecar.calibrate")) or n in (
        "engine_sidecar.cli.main", "engine_sidecar.cli.demo", "engine_sidecar.cli.serve", "engine_sidecar.engine_args")}

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for dep in edges[todo.pop()] & tools:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    cycles = sorted(n for n in tools if n in reach(n))
    assert cycles == [], f"import cycle through {cycles}"


def _top_level_imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    found = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    return found | {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}


def test_engine_args_stays_light():
    """The module every tool imports pulls in neither the engine nor the server at import time:
    only the standard library and the config its flags are generated from, itself plain data."""
    assert _top_level_imports("engine_args") <= {"__future__", "argparse", "pathlib", "typing", "collections.abc",
                                                 "engine_sidecar.engine_config"}
    assert _top_level_imports("engine_config") <= {"__future__", "dataclasses", "typing", "pathlib"}
