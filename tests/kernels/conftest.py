"""Kernel tests run Triton in its CPU interpreter; the variable must be set before triton is imported.

`triton.jit` decides between compiling and interpreting when a kernel module is imported, so this
runs at collection, before any test module imports ragcache_kernels.triton_*. Tests that need
triton skip themselves (pytest.importorskip) when it is not installed.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
