"""Sidecar lifecycle: SIGTERM drains and flushes the disk tier; a dropped stream frees its queue slot."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _start(model_dir, cache_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "engine_sidecar.cli", "serve", "--model", str(model_dir),
                             "--port", str(port), "--cache-dir", str(cache_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ,
                                                                                       "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("server did not start")


def test_sigterm_exits_cleanly_and_disk_tier_is_flushed(tiny_llama_dir, tmp_path):
    proc, base = _start(tiny_llama_dir, tmp_path / "kv")
    response = httpx.post(base + "/v1/chunks/warm", json={"chunks": [{"text": "A passage kept on disk."}]},
                          timeout=120)
    assert response.json()["computed"] == 1
    proc.send_signal(signal.SIGTERM)
    # uvicorn drains, runs the shutdown hook (engine.close flushes the disk writer), then re-raises
    # the signal, so the exit status is the signal's
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    assert list((tmp_path / "kv").glob("*/*.kv.safetensors"))
    assert not list((tmp_path / "kv").rglob("*.tmp"))


def test_client_that_drops_a_stream_does_not_block_the_engine(tiny_llama_dir, tmp_path):
    proc, base = _start(tiny_llama_dir, tmp_path / "kv")
    try:
        body = {"prompt": {"chunks": ["x y z"], "question": "Go on?"}, "sampling": {"max_tokens": 1500},
                "policy": "full", "stream": True}
        with httpx.stream("POST", base + "/v1/generate", json=body, timeout=60) as response:
            for _ in response.iter_lines():
                break  # the client goes away after the first event
        quick = {"prompt": {"question": "Hi?"}, "sampling": {"max_tokens": 2}}
        assert httpx.post(base + "/v1/generate", json=quick, timeout=300).status_code == 200
        for _ in range(120):  # the dropped stream's slot is released once its generator closes
            if httpx.get(base + "/health").json()["queue_depth"] == 0:
                break
            time.sleep(0.5)
        assert httpx.get(base + "/health").json()["queue_depth"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
