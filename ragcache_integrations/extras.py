"""One line that names the extra to install when an optional framework is missing."""

from __future__ import annotations

import importlib.util


def require(module: str, what: str, extra: str) -> None:
    """Raise ImportError naming `pip install 'ragcache[extra]'` when `module` cannot be imported."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or blocked
        found = False
    if not found:
        raise ImportError(f"this adapter needs {what} ({module}), which is not installed: "
                          f"pip install 'ragcache[{extra}]'")
