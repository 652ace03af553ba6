"""What a user meets with fewer extras installed than `all`: each command imports only what it
runs, and a missing piece is one line naming the extra to install. Missing packages are simulated
by blocking their import in a fresh interpreter (`sys.modules[name] = None`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(blocked: list[str], code: str) -> subprocess.CompletedProcess:
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _cli(blocked: list[str], *argv: str) -> subprocess.CompletedProcess:
    return _run(blocked, f"from engine_sidecar.cli.entry import main\nraise SystemExit(main({list(argv)!r}))\n")


BASE_INSTALL = ["torch", "transformers", "fastapi", "uvicorn", "ray", "uhashring", "redis", "rich"]
ENGINE_ONLY = ["fastapi", "uvicorn", "starlette", "prometheus_client", "ray", "uhashring", "redis"]


def test_the_base_install_cli_names_the_extra_in_one_line():
    # the help needs no engine (the benchmarks' flags load only when `bench` is parsed) ...
    helped = _cli(BASE_INSTALL, "--help")
    assert helped.returncode == 0 and "generate" in helped.stdout, helped.stderr
    # ... a command that runs the engine names its extra
    for argv in (["generate", "q", "--chunk", "a passage"], ["bench", "fidelity", "--help"]):
        done = _cli(BASE_INSTALL, *argv)
        assert done.returncode == 2, argv
        assert done.stderr.count("\n") == 1 and "pip install 'ragcache[engine]'" in done.stderr, done.stderr


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["bench", "gpu", "--help"], ["--version"],
                                  ["cache", "clear", "--help"]])
def test_help_and_version_need_neither_the_server_nor_the_cluster_extra(argv):
    done = _cli(ENGINE_ONLY, *argv)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and done.stdout


@pytest.mark.parametrize("argv,extra", [(["serve", "--model", "x", "--no-disk"], "server")])
def test_a_command_needing_a_missing_extra_says_which_in_one_line(argv, extra):
    done = _cli(ENGINE_ONLY, *argv)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and f"pip install 'ragcache[{extra}]'" in done.stderr, done.stderr


def test_serve_needs_no_cluster_extra(tiny_llama_dir):
    done = _cli(["ray", "uhashring"], "serve", "--model", str(tiny_llama_dir), "--port", "99999")
    assert done.returncode == 2 and "must be a TCP port from 0 to 65535" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "uhashring" not in done.stderr


@pytest.mark.parametrize("module,blocked,extra", [("ragcache_integrations.llama_index", "llama_index", "llama-index"),
                                                  ("ragcache_integrations.langchain", "langchain_core", "langchain")])
def test_an_adapter_without_its_framework_names_the_extra(module, blocked, extra):
    done = _run([blocked], f"import {module}\n")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and f"pip install 'ragcache[{extra}]'" in last, done.stderr


def test_the_packages_are_typed():
    assert (ROOT / "engine_sidecar" / "py.typed").is_file() and (ROOT / "ragcache_integrations" / "py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text()
    assert '"py.typed"' in text and "llama-index = " in text and '"langchain-classic' in text.split("langchain = ")[1]


def test_importing_the_engine_without_torch_is_one_message_with_nothing_chained():
    done = _run(["torch", "transformers"], "from engine_sidecar import Engine\n")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and "pip install 'ragcache[engine]'" in last, done.stderr
    assert "direct cause" not in done.stderr and "ModuleNotFoundError" not in done.stderr, done.stderr


def test_the_install_docs_list_every_extra_and_what_all_pulls():
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    table = dict(re.findall(r"^\| `([a-z-]+)` \| ([^|]+) \|$", (ROOT / "docs" / "install.md").read_text(), re.M))
    aliases = {name for name, reqs in extras.items() if reqs == [f"ragcache[{name.replace('-', '')}]"]}
    assert set(table) == set(extras) - aliases
    pulled = re.fullmatch(r"ragcache\[(.+)\]", extras["all"][0]).group(1).split(",")
    assert [w.strip() for w in table["all"].split("(")[0].split(",")] == pulled
