"""The dependency rule, checked on the source: first-party modules (the benchmark lab's too) form
no import cycle (lazy and type-only imports count), nobody imports another module's private names,
the adapters never import the engine (so they install and import without torch), the engine's
stages take only the wire types from the adapter package, and the product never imports the
benchmark lab (which is not in the wheel): the lab builds on the product, not the reverse."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine_sidecar", "ragcache_integrations", "ragcache_lab")
PRODUCT = ("engine_sidecar", "ragcache_integrations")
LAB = "ragcache_lab"
TOOLS = ("engine_sidecar.calibrate", "engine_sidecar.cli", "engine_sidecar.server", "engine_sidecar.engine_args")
# The request's stages, lowest first: a module imports only from its own layer or one below (lazy
# and type-only imports count). docs/architecture.md walks a request through them in this order.
LAYERS = (
    ("engine_sidecar", "engine_sidecar.errors", "engine_sidecar.paths", "engine_sidecar.engine_config"),
    ("engine_sidecar.model",),
    ("engine_sidecar.store",),
    ("engine_sidecar.request",),
    ("engine_sidecar.execution",),
    ("engine_sidecar.reuse",),
    ("engine_sidecar.engine",),
    ("engine_sidecar.engine_args",),
    ("engine_sidecar.server",),
    ("engine_sidecar.vllm_backend",),
    ("engine_sidecar.cluster",),
    ("engine_sidecar.calibrate",),
    ("engine_sidecar.cli",),
)
WIRE_TYPES = {"ragcache_integrations", "ragcache_integrations.types", "ragcache_integrations.api_models",
              "ragcache_integrations.policy_registry", "ragcache_integrations.access_table"}


def _modules() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            files[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return files


def _imports(path: Path, known: set[str]) -> list[tuple[str, list[str]]]:
    """(first-party module, names imported from it) for every import anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, []) if sub in known else (node.module, [alias.name]))
    out = []
    for name, names in found:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            out.append((name, names))
    return out


def _graph() -> dict[str, set[str]]:
    files = _modules()
    known = set(files)
    graph = {}
    for name, path in files.items():
        deps = {dep for dep, _ in _imports(path, known)}
        # a package's __init__ re-exports its modules; a module importing its own package's name
        # is importing one of its siblings, not the package's re-export list
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def test_no_import_cycles():
    graph = _graph()

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    cycles = sorted(n for n in graph if not n.endswith("__init__") and n in reach(n))
    assert cycles == [], f"import cycles through {cycles}"


def _layer(module: str) -> int:
    """The index of the layer a module of engine_sidecar belongs to (its package's, or its own)."""
    found = [i for i, layer in enumerate(LAYERS) for top in layer
             if module == top or (top != "engine_sidecar" and module.startswith(top + "."))]
    assert len(found) == 1, f"{module} is in {len(found)} layers: place it in exactly one"
    return found[0]


def test_engine_sidecar_has_few_top_level_modules():
    top = sorted(p.name for p in (ROOT / "engine_sidecar").glob("*.py"))
    assert len(top) <= 8, top


def test_imports_only_go_down_the_layers():
    graph = _graph()
    upward = sorted(f"{name} -> {dep}" for name, deps in graph.items() if name.startswith("engine_sidecar")
                    for dep in deps if dep.startswith("engine_sidecar") and _layer(dep) > _layer(name))
    assert upward == []


def test_no_private_names_cross_modules():
    files = _modules()
    offenders = [f"{name} imports {dep}.{n}" for name, path in files.items()
                 for dep, names in _imports(path, set(files)) for n in names
                 if n.startswith("_") and not n.startswith("__") and dep != name]
    assert offenders == []


def test_adapters_never_import_the_engine():
    graph = _graph()
    offenders = sorted(n for n, deps in graph.items() if n.startswith("ragcache_integrations")
                       and any(d.startswith("engine_sidecar") for d in deps))
    assert offenders == []


def test_the_product_never_imports_the_lab():
    graph = _graph()
    offenders = sorted(f"{n} -> {d}" for n, deps in graph.items() if n.startswith(PRODUCT)
                       for d in deps if d == LAB or d.startswith(LAB + "."))
    assert offenders == []
    # `ragcache bench` loads the lab by its module name (no import statement), from the checkout,
    # in exactly one module; elsewhere only the folder may be named (`ragcache_lab/`, in help text)
    by_name = re.compile(rf"\b{LAB}\b(?!/)")
    naming = sorted(path.relative_to(ROOT).as_posix() for package in PRODUCT for path in (ROOT / package).rglob("*.py")
                    if by_name.search(path.read_text(encoding="utf-8")))
    assert naming == ["engine_sidecar/cli/lab.py"]


def test_the_lab_builds_on_the_product():
    """The other direction is the point: what the product's commands need lives in the product, and
    the lab reuses it rather than keeping its own copy."""
    graph = _graph()
    assert "engine_sidecar.calibrate.reference" in graph["ragcache_lab.fidelity"]
    assert "engine_sidecar.calibrate.metrics" in graph["ragcache_lab.fidelity"]


def test_engine_stages_take_only_wire_types_from_the_adapter_package():
    graph = _graph()
    offenders = sorted(f"{n} -> {d}" for n, deps in graph.items()
                       if n.startswith("engine_sidecar") and not n.startswith(TOOLS)
                       for d in deps if d.startswith("ragcache_integrations") and d not in WIRE_TYPES)
    assert offenders == []


def test_without_torch_the_adapters_import_and_the_engine_names_its_extra():
    """The base install has no torch: the adapters and the client work, and the engine fails
    with one line naming the extra (sys.modules['torch'] = None makes `import torch` fail)."""
    import subprocess
    import sys

    code = ("import sys\nsys.modules['torch'] = None\n"
            "import ragcache_integrations, ragcache_integrations.client, ragcache_integrations.langchain\n"
            "import engine_sidecar  # the package itself loads nothing heavy: the CLI can name extras\n"
            "try:\n    from engine_sidecar import Engine\nexcept ImportError as exc:\n    print(exc)\n"
            "else:\n    raise SystemExit('the engine imported without torch')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "ragcache[engine]" in out.stdout and "torch==2.13.0" in out.stdout
