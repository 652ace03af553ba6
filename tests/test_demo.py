"""The main job on the real default model: it prints answers and what reuse saved."""

from __future__ import annotations

import os
import subprocess
import sys


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
