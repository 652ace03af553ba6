"""Where ragcache keeps its files: $RAGCACHE_HOME, default ~/.cache/ragcache."""

from __future__ import annotations

import os
from pathlib import Path


def ragcache_home() -> Path:
    return Path(os.environ.get("RAGCACHE_HOME", Path.home() / ".cache" / "ragcache")).expanduser()


def default_model_dir() -> Path:
    return ragcache_home() / "models" / "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    return ragcache_home() / "kv"
