"""`ragcache bench` takes its subcommands from the checkout's ragcache_lab/, which the wheel does
not ship: found from an editable install run anywhere, and without a checkout one line and exit
code 2 (never a traceback), while `ragcache --help` still lists the command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(argv: list[str], cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    code = (f"import sys\nsys.argv = ['ragcache', *{argv!r}]\n"
            "from engine_sidecar.cli.entry import main\nraise SystemExit(main())\n")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def installed_without_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The product's packages as a wheel lays them out: no ragcache_lab/ beside engine_sidecar/."""
    site = tmp_path_factory.mktemp("site-packages")
    for package in ("engine_sidecar", "ragcache_integrations"):
        shutil.copytree(ROOT / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    return site


@pytest.mark.parametrize("argv", [["bench", "fidelity", "--help"], ["bench"], ["bench", "gpu", "--quick"]])
def test_without_a_checkout_bench_says_where_the_benchmarks_are(installed_without_checkout, argv):
    done = _cli(argv, cwd=installed_without_checkout.parent, pythonpath=installed_without_checkout)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert "ragcache_lab/" in done.stderr and "clone of the repository" in done.stderr
    assert "Traceback" not in done.stderr


def test_without_a_checkout_the_help_still_lists_bench(installed_without_checkout):
    done = _cli(["--help"], cwd=installed_without_checkout.parent, pythonpath=installed_without_checkout)
    assert done.returncode == 0, done.stderr
    assert "    bench " in done.stdout


def test_an_editable_install_finds_the_lab_from_any_folder(tmp_path):
    """The console script's folder is on sys.path, not the checkout: the lab is found beside the
    package it runs from."""
    done = _cli(["bench", "route-replay", "--help"], cwd=tmp_path)
    if done.returncode != 0 and "clone of the repository" in done.stderr:
        pytest.skip("engine_sidecar is installed from a wheel here, not from this checkout")
    assert done.returncode == 0, done.stderr
    assert "usage: ragcache bench route-replay" in done.stdout
