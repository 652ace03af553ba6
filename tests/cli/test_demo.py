"""The main job on the real default model: it prints answers and what reuse saved."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_demo_prints_answers_and_reuse(smol_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine_sidecar.cli", "demo", "--model", str(smol_dir), "--no-disk",
         "--max-tokens", "12"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("\nA") >= 3  # three answers printed
    answers = [line for line in out.splitlines() if line.startswith("A") and len(line.split()) > 1]
    assert all(len(a.split(maxsplit=1)[1].strip()) > 0 for a in answers)
    assert "what reuse saved" in out
    assert "3/3" in out  # later turns hit every chunk


def test_chatbot_demo_end_to_end_stops_its_sidecar(smol_dir, tmp_path):
    """`make demo`: real sidecar process, real Qdrant local mode and MiniLM, three related turns."""
    import re

    import httpx

    from examples.chatbot import ingest

    assert ingest.main(["--corpus", str(ingest.BUNDLED_CORPUS), "--qdrant-path", str(tmp_path / "q")]) == 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.chatbot.demo", "--qdrant-path", str(tmp_path / "q"), "--model", str(smol_dir),
         "--max-tokens", "12"],
        capture_output=True, text=True, env=env, timeout=900, cwd=ingest.ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert all(f"[A{n}]" in out for n in (1, 2, 3))
    assert out.count("  source demo-") >= 3
    reused = [int(m) for m in re.findall(r"tokens reused (\d+)", out)]
    assert len(reused) == 3 and reused[1] > 0 and reused[2] > 0
    assert "speed-up" in out and "sidecar stopped" in out
    sidecar = re.search(r"ragcache serving on (http://\S+)", out)
    assert sidecar is not None
    with pytest.raises(httpx.TransportError):
        httpx.get(sidecar.group(1) + "/health", timeout=5)
