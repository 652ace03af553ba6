"""The `ragcache` command's flags as a user meets them: ranges checked in one line, `--version`,
and `cache clear`, which deletes the disk tier without loading a model and refuses while a running
sidecar serves the folder."""

from __future__ import annotations

import httpx
import pytest

from tests.cli.test_cli_errors import run_cli
from tests.server.test_server_process import ServerProcess

PASSAGE = "Mount Fuji is 3,776 m high. The Nile flows north."


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--port", "99999"], "must be a TCP port from 0 to 65535"),
    (["serve", "--port", "-1"], "must be a TCP port"),
    (["serve", "--ram-cache-gb", "-1"], "--ram-cache-gb/--gpu-cache-gb: must be >= 0"),
    (["serve", "--conversation-ram-gb", "nan"], "--conversation-ram-gb: must be >= 0"),
    (["serve", "--remember-passages", "-1"], "--remember-passages: must be >= 0"),
    (["generate", "--question", "q", "--policy", "cacheblend:"], "a ':' must be followed by a value"),
    (["generate", "--question", "q", "--policy", "bogus"], "unknown policy 'bogus'"),
    (["generate", "q", "--max-tokens", "0"], "--max-tokens: must be from 1 to 4096"),
    (["generate", "q", "--temperature", "9"], "--temperature: must be from 0 to 5"),
    (["generate", "q", "--temperature", "nan"], "--temperature: must be >= 0"),
])
def test_a_bad_flag_is_one_line_naming_it(tmp_path, argv, needle):
    proc = run_cli(*argv, home=tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "--help" in lines[0], proc.stderr


def test_version(tmp_path):
    proc = run_cli("--version", home=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("ragcache ")


def test_cache_clear_help_holds_only_its_own_flags(tmp_path):
    proc = run_cli("cache", "clear", "--help", home=tmp_path)
    assert proc.returncode == 0 and "--chunk-id" in proc.stdout and "--cache-dir" in proc.stdout
    assert "--ram-cache-gb" not in proc.stdout and "--policy" not in proc.stdout


def test_cache_clear_refuses_while_a_sidecar_serves_the_folder(tiny_llama_dir, tmp_path):
    kv = tmp_path / "kv"
    with ServerProcess(tiny_llama_dir, kv, tmp_path / "serve.log") as proc:
        assert httpx.post(proc.base + "/v1/chunks/warm", json={"chunks": [PASSAGE]}, timeout=60).json()["computed"] == 1
        httpx.get(proc.base + "/v1/cache/stats", timeout=60)
        held = httpx.get(proc.base + "/v1/cache/stats", timeout=60).json()["ram_entries"]
        refused = run_cli("cache", "clear", "--cache-dir", str(kv), home=tmp_path)
        assert refused.returncode == 2 and "DELETE" in refused.stderr and "pid" in refused.stderr, refused.stderr
        assert httpx.get(proc.base + "/v1/cache/stats", timeout=60).json()["ram_entries"] == held > 0
    files = list(kv.rglob("*.kv.safetensors"))
    assert files  # written by the sidecar before it stopped
    cleared = run_cli("cache", "clear", "--cache-dir", str(kv), home=tmp_path)
    assert cleared.returncode == 0 and f"removed {len(files)} cache entries" in cleared.stdout, cleared.stderr
    assert not list(kv.rglob("*.kv.safetensors"))
    again = run_cli("cache", "clear", "--cache-dir", str(tmp_path / "nothing-here"), home=tmp_path)
    assert again.returncode == 0 and "removed 0" in again.stdout


def test_generate_help_explains_every_argument(tmp_path):
    import re

    proc = run_cli("generate", "--help", home=tmp_path)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for name in ("question", "--max-tokens MAX_TOKENS", "--temperature TEMPERATURE", "--chunk CHUNK"):
        assert re.search(re.escape(name) + r" [A-Za-z]", text.split("options:")[-1] if name != "question"
                         else text.split("positional arguments:")[-1]), name


def test_serve_help_names_every_route_the_server_has(tmp_path):
    import re
    from pathlib import Path

    import engine_sidecar.server

    proc = run_cli("serve", "--help", home=tmp_path)
    assert proc.returncode == 0
    described = " ".join(proc.stdout.split())
    sources = "".join(p.read_text(encoding="utf-8") for p in Path(engine_sidecar.server.__file__).parent.glob("*.py"))
    routes = set(re.findall(r'@router\.[a-z_]+\("(/[a-z0-9/_]+)"(?![^)]*include_in_schema=False)', sources))
    assert {"/v1/generate", "/v1/models", "/health"} <= routes
    assert [route for route in sorted(routes) if route not in described] == []
