"""Where `ragcache bench` finds its subcommands. The benchmarks are the project checkout's
`ragcache_lab/` package, beside `engine_sidecar/` and never in the wheel; this is the one place
the product imports it, and only when `bench` is parsed."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

import engine_sidecar

LAB = "ragcache_lab"
MISSING = ("ragcache: error: the benchmarks live in the project checkout's ragcache_lab/ folder: run "
           "`ragcache bench ...` from a clone of the repository (pip install -e .)")


def checkout_root() -> Path:
    """The folder holding `engine_sidecar/`: a checkout's root when the package runs from one
    (an editable install), site-packages for a wheel."""
    return Path(engine_sidecar.__file__).resolve().parents[1]


def lab_cli() -> ModuleType | None:
    """`ragcache_lab.cli`, importable as is (a checkout on sys.path) or from the checkout this
    package runs from (an editable install maps only the wheel's packages); None when there is
    no checkout."""
    try:
        return importlib.import_module(f"{LAB}.cli")
    except ModuleNotFoundError as exc:
        if exc.name != LAB:  # the lab is there but lacks something: that error is the message
            raise
    root = checkout_root()
    if not (root / LAB / "__init__.py").is_file():
        return None
    # appended, not prepended: the checkout's other folders must not shadow installed packages
    sys.path.append(str(root))
    return importlib.import_module(f"{LAB}.cli")


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    """The lab's subcommands on `bench`; without a checkout, one line and exit code 2."""
    cli = lab_cli()
    if cli is None:
        bench.exit(2, MISSING + "\n")
    cli.add_bench_commands(bench)
