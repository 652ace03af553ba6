"""The extras as a user installs them: a fresh virtualenv, the project from its tracked files,
then one extra at a time, each checked with what a user runs next. Ordered so that an extra
never leans on a package only a later one brings: the base install (no torch), LangChain, then
torch and LlamaIndex (whose Hugging Face embeddings need torch: installed first, as the README
says, so no CUDA build is pulled), then the server. Needs the package registries, like the
README's install; several minutes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"


def _tracked_tree(dest: Path) -> Path:
    """The project as a clone holds it (no .venv, no build output) in a folder of its own."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


class Venv:
    def __init__(self, folder: Path):
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)
        self.bin = folder / "bin"
        # the user's shell: nothing of this test run's environment leaks into the install
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "RAGCACHE"))}
        self.env["PATH"] = f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"

    def pip_install(self, *requirements: str) -> None:
        done = subprocess.run([str(self.bin / "python"), "-m", "pip", "install", "--quiet", *requirements],
                              capture_output=True, text=True, env=self.env, timeout=1800)
        assert done.returncode == 0, f"pip install {' '.join(requirements)} failed:\n{done.stderr[-3000:]}"

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=600, cwd=self.bin.parent)

    def python(self, code: str) -> subprocess.CompletedProcess:
        return self.run(str(self.bin / "python"), "-c", code)

    def version_of(self, package: str) -> str:
        return self.python(f"import importlib.metadata as m; print(m.version({package!r}))").stdout.strip()


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_each_extra_installs_alone_and_runs_what_it_is_for(tmp_path):
    src = _tracked_tree(tmp_path / "src")
    venv = Venv(tmp_path / "venv")

    # the base install: the HTTP client and the adapters' shared parts, no torch
    venv.pip_install(str(src))
    assert venv.version_of("torch") == "", "the base install pulled torch"
    assert venv.python("from ragcache_integrations.client import RagCacheClient").returncode == 0
    done = venv.run(str(venv.bin / "ragcache"), "--help")  # the help needs no engine
    assert done.returncode == 0 and "generate" in done.stdout, done.stderr
    done = venv.run(str(venv.bin / "ragcache"), "generate", "q", "--chunk", "a passage")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "pip install 'ragcache[engine]'" in done.stderr
    done = venv.python("import ragcache_integrations.llama_index")
    assert done.returncode == 1 and "pip install 'ragcache[llama-index]'" in _last_line(done), done.stderr
    done = venv.python("import ragcache_integrations.langchain")
    assert done.returncode == 1 and "pip install 'ragcache[langchain]'" in _last_line(done), done.stderr

    # LangChain: the adapters, and create_retrieval_chain where LangChain 1.x keeps it
    venv.pip_install(f"{src}[langchain]")
    done = venv.python("from ragcache_integrations.langchain import ChunkCachedChatModel, ChunkCachedRunnable\n"
                       "from langchain_classic.chains import create_retrieval_chain")
    assert done.returncode == 0, done.stderr
    assert venv.version_of("torch") == "", "the langchain extra pulled torch"

    # LlamaIndex under the name people type, after the CPU torch the README installs first
    venv.pip_install(TORCH)
    venv.pip_install(f"{src}[llama-index]")
    done = venv.python("from ragcache_integrations.llama_index import ChunkCachedLLM\n"
                       "from llama_index.core import VectorStoreIndex")
    assert done.returncode == 0, done.stderr
    assert venv.version_of("torch").split("+")[0] == TORCH.split("==")[1], "the llama-index extra replaced torch"

    # the server: `ragcache serve` builds its parser without the cluster extra
    venv.pip_install(f"{src}[server]")
    done = venv.run(str(venv.bin / "ragcache"), "serve", "--help")
    assert done.returncode == 0 and "--remember-passages" in done.stdout, done.stderr
    assert venv.version_of("uhashring") == "" and venv.version_of("ray") == ""
    done = venv.run(str(venv.bin / "ragcache"), "--version")
    assert done.returncode == 0 and done.stdout.startswith("ragcache "), done.stderr
