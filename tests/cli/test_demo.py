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
    """`make demo`: real sidecar process, real Qdrant local mode and MiniLM; two users, four chats.
    Chats after the first fuse passages another chat cached, each answer is shown beside full
    prefill's, and the sidecar is gone at the end."""
    import re

    import httpx

    from examples.chatbot import ingest

    assert ingest.main(["--corpus", str(ingest.BUNDLED_CORPUS), "--qdrant-path", str(tmp_path / "q")]) == 0
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "TMPDIR": str(scratch)}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.chatbot.demo", "--qdrant-path", str(tmp_path / "q"), "--model", str(smol_dir),
         "--max-tokens", "12"],
        capture_output=True, text=True, env=env, timeout=900, cwd=ingest.ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    asked = re.findall(r"^\[Q(\d)\] \((\w+), chat (\d)\) ", out, re.M)
    assert [n for n, _, _ in asked] == ["1", "2", "3", "4", "5"] and {u for _, u, _ in asked} == {"ana", "ben"}
    assert out.count("full prefill's answer: ") == 5 and out.count("  source demo-") >= 5
    turns = re.findall(r"chunk hits (\d+)/(\d+).*? \| tokens reused (\d+) \(fused (\d+)\)", out)
    assert len(turns) == 5
    chats = [f"{user}-{chat}" for _, user, chat in asked]
    assert int(turns[0][0]) == 0  # a fresh cache: the first question computes its passages
    # chunk fusion across chats: passages the first chat cached, reused at new positions in another
    fused_elsewhere = [n for n, (hits, _, _, fused) in enumerate(turns)
                       if int(hits) > 0 and int(fused) > 0 and chats[n] not in chats[:n]]
    assert len(fused_elsewhere) >= 2, out
    assert int(turns[2][2]) > 0 and chats[2] in chats[:2]  # the follow-up continues its chat's KV
    assert re.search(r"Chunk fusion: [2-5] of 5 questions", out) and "speed-up" in out and "sidecar stopped" in out
    sidecar = re.search(r"ragcache serving on (http://\S+)", out)
    assert sidecar is not None
    with pytest.raises(httpx.TransportError):
        httpx.get(sidecar.group(1) + "/health", timeout=5)
    # a finished run leaves no chunk cache behind in the temporary folder (hundreds of MB a run)
    assert not list(scratch.glob("ragcache-demo-*")), list(scratch.iterdir())


def test_the_demo_script_is_checked_before_anything_starts(tmp_path):
    bad = tmp_path / "turns.json"
    bad.write_text('{"turns": [{"user": "ana", "chat": "one", "question": "Why?"}]}')
    proc = subprocess.run([sys.executable, "-m", "examples.chatbot.demo", "--questions", str(bad),
                           "--qdrant-path", str(tmp_path / "q")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "'turns' needs" in lines[0], proc.stderr


def test_the_demo_table_fits_an_80_column_terminal_without_cutting_cells():
    """`make demo` piped or in a plain terminal renders at 80 columns: no cell cut to '…'."""
    from rich.console import Console

    from examples.chatbot.demo import Answered, Turn, summary_table

    stats = {"chunk_hits": 12, "chunks": 12, "tokens_fused": 12345, "tokens_computed": 12345, "ttft_s": 12.34}
    rows = [Answered(Turn("benedict", 12, "q"), stats, {"ttft_s": 123.45}, "a b c", "a b c d e f g h i j k l")] * 3
    console = Console(width=80, record=True)
    console.print(summary_table(rows, "cacheblend:0.15:min24"))
    text = console.export_text()
    assert "…" not in text  # nothing cut: text cells wrap, numbers stay whole
    assert all(number in text for number in ("12/12", "12345", "12.34s", "123.45s", "10.0x", "3/12"))
