"""What `pip install ragcache` ships: the product's packages, all of them, with their data files,
and none of the benchmark lab (ragcache_lab/ runs from a checkout). The wheel is built offline from
a copy of the sources with this environment's setuptools (seconds), so the checkout is left as it
is (no build/ or egg-info written into it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "engine_sidecar", "ragcache_integrations", "kernels", "ragcache_lab")
PRODUCT = ("engine_sidecar", "ragcache_integrations")


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    pytest.importorskip("setuptools")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(path, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "-w", str(work / "dist"), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (work / "dist").glob("ragcache-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_the_lab_is_not_in_the_wheel(wheel_files: set[str]) -> None:
    assert not [n for n in wheel_files if n.startswith(("ragcache_lab/", "engine_sidecar/bench/"))]
    # nor a benchmark module under another name's folder: no file named as one of the lab's own modules
    product_names = {p.name for package in PRODUCT for p in (ROOT / package).rglob("*.py")}
    lab_only = {p.name for p in (ROOT / "ragcache_lab").glob("*.py")} - product_names
    assert lab_only, "the lab has modules of its own"
    assert not sorted(n for n in wheel_files if n.rsplit("/", 1)[-1] in lab_only)


def test_what_users_run_on_their_own_model_is_in_the_wheel(wheel_files: set[str]) -> None:
    calibrate = {p.relative_to(ROOT).as_posix() for p in (ROOT / "engine_sidecar" / "calibrate").glob("*.py")}
    assert "engine_sidecar/calibrate/temperature.py" in calibrate and calibrate <= wheel_files
    assert "engine_sidecar/cli/lab.py" in wheel_files  # `ragcache bench` says where the benchmarks are
    assert "engine_sidecar/execution/known_temperatures.json" in wheel_files


def test_every_product_package_is_in_the_wheel(wheel_files: set[str]) -> None:
    """pyproject lists the packages one by one: a new subpackage left off the list would install
    as a missing module."""
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for package in PRODUCT
                      for p in (ROOT / package).rglob("__init__.py") if "__pycache__" not in p.parts)
    assert [p for p in packages if f"{p}/__init__.py" not in wheel_files] == []
    assert "ragcache_kernels/cpu_native.py" in wheel_files  # kernels/, under the name it is imported by
