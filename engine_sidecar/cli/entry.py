"""The `ragcache` command's entry point: the CLI, or one line naming the extra to install when the
base install (adapters and client only) lacks what a command needs."""

from __future__ import annotations

import sys

# top-level modules -> the extra that installs them
EXTRA_OF = {"torch": "engine", "transformers": "engine", "safetensors": "engine", "gguf": "engine",
            "numpy": "engine", "rich": "engine", "tqdm": "engine", "accelerate": "engine",
            "fastapi": "server", "uvicorn": "server", "starlette": "server", "prometheus_client": "server",
            "ray": "cluster", "uhashring": "cluster", "redis": "redis", "xxhash": "redis",
            "qdrant_client": "qdrant", "sentence_transformers": "qdrant", "matplotlib": "bench", "psutil": "bench",
            "triton": "triton", "llama_index": "llama-index", "langchain_core": "langchain"}


def missing_extra_message(exc: ImportError) -> str:
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return f"ragcache: error: {exc}"
    return (f"ragcache: error: this command needs {top}, which the '{extra}' extra installs: "
            f"pip install 'ragcache[{extra}]' (or 'ragcache[all]')")


def main(argv: list[str] | None = None) -> int:
    try:
        from engine_sidecar.cli.main import main as cli_main

        return cli_main(argv)
    except ImportError as exc:  # only the imports the command needs run: a base install lacks some
        print(missing_extra_message(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
