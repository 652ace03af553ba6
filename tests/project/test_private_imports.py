"""No module imports another first-party module's private names (`from m import _helper`), and
no module outside the tests reaches one through an imported module (`m._helper()`): a name
another module needs is an API between the two, so it goes public, or the helper moves to the
module that uses it. Dunder names (`__version__`) are fine; third-party modules' private names
are not ours to rename. Tests may still patch a module's internals by attribute (fault
injection)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# folder -> the package it installs as (kernels/ is `ragcache_kernels`)
FOLDERS = {"engine_sidecar": "engine_sidecar", "kernels": "ragcache_kernels",
           "ragcache_integrations": "ragcache_integrations", "ragcache_lab": "ragcache_lab", "tests": "tests"}
FIRST_PARTY = frozenset(FOLDERS.values())
CHECKED = tuple(folder for folder in FOLDERS if (ROOT / folder).is_dir())


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = FOLDERS[parts[0]]
    return ".".join(parts).removesuffix(".__init__")


def imported_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """'line: from m import _name' for each private name `module` imports from another
    first-party module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        origin = imported_module(node, module, is_package)
        if origin.split(".")[0] not in FIRST_PARTY or origin == module:
            continue
        found += [f"{node.lineno}: from {origin} import {alias.name}" for alias in node.names
                  if is_private(alias.name)]
    return found


def private_attributes(source: str, modules: set[str]) -> list[str]:
    """'line: m._name' for each private name read off a first-party module that the source
    imports as a name (`from pkg import m`, `import pkg.m as m`)."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({alias.asname: alias.name for alias in node.names if alias.asname and alias.name in modules})
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            bound.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names
                          if f"{node.module}.{alias.name}" in modules})
    return [f"{node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
            and is_private(node.attr)]


def test_the_check_finds_private_imports_and_lets_the_rest_through():
    offending = ("from engine_sidecar.store.disk import _runs\n"
                 "from ragcache_kernels.triton_attention import (\n    LOG2E,\n    _FAR,\n)\n"
                 "from .sibling import _helper\n")
    assert private_imports(offending, "ragcache_kernels.triton_prefill_table") == [
        "1: from engine_sidecar.store.disk import _runs", "2: from ragcache_kernels.triton_attention import _FAR",
        "6: from ragcache_kernels.sibling import _helper"]
    allowed = ("from engine_sidecar import __version__\n"  # dunder
               "from vllm import _custom_ops\n"  # third party
               "from ragcache_kernels._triton_common import check_device\n"  # a public name of a private module
               "from ragcache_kernels.attention import selective_attention\n")
    assert private_imports(allowed, "ragcache_kernels.dispatch") == []
    modules = {"engine_sidecar.execution.kernel_warmup", "ragcache_kernels.attention"}
    reaching = ("from engine_sidecar.execution import kernel_warmup\n"
                "from ragcache_kernels import attention as _attention\n"
                "kernel_warmup._ids(4, 9, 1)\n_attention.selective_attention\nkernel_warmup.__name__\n"
                "other._private\n")
    assert private_attributes(reaching, modules) == ["3: kernel_warmup._ids"]


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found = private_imports(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")
            offenders += [f"{path.relative_to(ROOT).as_posix()}:{line}" for line in found]
    assert offenders == [], ("make these names public (they are an API between modules) or move the helper "
                             "to the module that uses it:\n" + "\n".join(offenders))


def test_no_module_outside_tests_reads_another_modules_private_names():
    files = {module_name(path): path for folder in CHECKED for path in (ROOT / folder).rglob("*.py")}
    offenders = [f"{path.relative_to(ROOT).as_posix()}:{line}" for name, path in sorted(files.items())
                 if path.relative_to(ROOT).parts[0] != "tests"
                 for line in private_attributes(path.read_text(encoding="utf-8"), set(files))]
    assert offenders == [], "make these names public or move the helper to its user:\n" + "\n".join(offenders)
