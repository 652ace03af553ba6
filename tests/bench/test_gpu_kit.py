"""The GPU kit: the wheels it packs are the server stack's whole closure at the versions installed
here, and `run` from a plain checkout (no install of this project) brings `ragcache_kernels` in
from `kernels/` and writes the benchmark's JSON, table and log."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from ragcache_lab.gpu_kit import SERVER_ROOTS, requirement_closure

ROOT = Path(__file__).resolve().parents[2]


def test_the_packed_wheels_are_the_server_stacks_closure_at_the_installed_versions():
    closure = requirement_closure(SERVER_ROOTS)
    # what the app imports beyond the GPU image, and what those need in turn
    assert {"pydantic", "pydantic-core", "fastapi", "starlette", "uvicorn", "annotated-types", "h11",
            "prometheus-client"} <= set(closure)
    assert all(closure[name] == metadata.version(name) for name in closure)
    # extras are left out: uvicorn[standard]'s uvloop and fastapi[all]'s jinja2 are not required
    assert "uvloop" not in closure and "jinja2" not in closure


def _kit(tmp_path: Path, smol_dir: Path) -> Path:
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)  # this venv has the server stack: nothing to install
    (kit / "tokenizer").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smol_dir / name).is_file():
            shutil.copy(smol_dir / name, kit / "tokenizer" / name)
    return kit


def test_run_benchmarks_from_the_kit_and_links_the_kernels(smol_dir, tmp_path):
    kit, site, out = _kit(tmp_path, smol_dir), tmp_path / "site", tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "ragcache_lab.gpu_kit", "run", "--kit", str(kit), "--site",
                           str(site), "--out", str(out), "--", "--device", "cpu", "--quick", "--concurrency", "1",
                           "--http-clients", "0"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (site / "ragcache_kernels").resolve() == (ROOT / "kernels").resolve()
    report = json.loads((out / "bench-gpu.json").read_text())
    assert report["guards"]["pass"] and report["config"]["tokenizer"] == str(kit / "tokenizer")
    assert "http_tiny" not in report  # --http-clients 0 skips the section
    log = (out / "bench-gpu.log").read_text()
    assert "== ttft_tiny" in log and (out / "bench-gpu.md").read_text().strip() in log


def test_run_without_a_packed_kit_says_how_to_make_one(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ragcache_lab.gpu_kit", "run", "--kit", str(tmp_path / "none"),
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "make gpu-kit" in done.stderr and "Traceback" not in done.stderr
