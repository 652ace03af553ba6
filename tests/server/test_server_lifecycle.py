"""Sidecar lifecycle with real processes (tiny random model: it never emits EOS, so generations
run exactly max_tokens): the bounded queue answers 429, a client that leaves cancels its
generation, the request timeout gives 504, and SIGTERM drains, cancels and flushes the disk tier."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx

from tests.server.test_server_process import ServerProcess

# ~2.5 s of decoding on the tiny model, unless cancelled
LONG = {"prompt": {"chunks": ["x y z"], "question": "Go on?"}, "sampling": {"max_tokens": 1900}, "policy": "full"}
QUICK = {"prompt": {"question": "Hi?"}, "sampling": {"max_tokens": 2}}


def _first_event(lines: Iterator[str]) -> str:
    # keep iterating the same iterator afterwards: a discarded httpx line iterator closes the
    # connection, which the server rightly takes for a client that left
    return next(line for line in lines if line.startswith("data:"))


def test_full_queue_gives_429_and_a_dropped_stream_frees_the_engine(tiny_llama_dir, tmp_path):
    with ServerProcess(tiny_llama_dir, tmp_path / "kv", tmp_path / "log", "--max-queue", "1") as server:
        with httpx.stream("POST", server.base + "/v1/generate", json={**LONG, "stream": True}, timeout=60) as long:
            lines = long.iter_lines()
            assert '"delta"' in _first_event(lines)
            refused = httpx.post(server.base + "/v1/generate", json=QUICK, timeout=60)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            del lines
        # the client left after one token: the engine stops at its next token and frees the slot
        for _ in range(100):
            if httpx.get(server.base + "/health").json()["queue_depth"] == 0:
                break
            time.sleep(0.05)
        assert httpx.post(server.base + "/v1/generate", json=QUICK, timeout=60).status_code == 200
        assert server.metric("ragcache_engine_jobs_total", endpoint="generate", outcome="disconnected") == 1
        assert server.metric("ragcache_engine_jobs_total", endpoint="generate", outcome="rejected") == 1
        assert server.metric("ragcache_requests_total", route="/v1/generate", status="429") == 1


def test_request_timeout_is_504_json_or_an_error_event(tiny_llama_dir, tmp_path):
    with ServerProcess(tiny_llama_dir, tmp_path / "kv", tmp_path / "log", "--request-timeout", "0.5") as server:
        late = httpx.post(server.base + "/v1/generate", json=LONG, timeout=60)
        assert late.status_code == 504 and late.json()["error"]["type"] == "timeout_error"
        with httpx.stream("POST", server.base + "/v1/generate", json={**LONG, "stream": True}, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        if r.status_code == 200:  # the first token came in time: the stream ends with an error event
            last = json.loads(events[-1][5:])
            assert last["type"] == "error" and last["status"] == 504
        else:
            assert r.status_code == 504
        assert httpx.get(server.base + "/health").json()["queue_depth"] == 0
        assert server.metric("ragcache_engine_jobs_total", endpoint="generate", outcome="timeout") == 2


def test_sigterm_cancels_in_flight_work_after_the_grace_and_flushes_the_disk_tier(tiny_llama_dir, tmp_path):
    server = ServerProcess(tiny_llama_dir, tmp_path / "kv", tmp_path / "log", "--shutdown-grace", "0.5").start()
    try:
        warmed = httpx.post(server.base + "/v1/chunks/warm", json={"chunks": ["A passage kept on disk."]}, timeout=120)
        assert (warmed.json()["chunks"], warmed.json()["computed"]) == (1, 1)
        long = {**LONG, "sampling": {"max_tokens": 1900}, "stream": True}
        with httpx.stream("POST", server.base + "/v1/generate", json=long, timeout=60) as response:
            stream = response.iter_lines()
            _first_event(stream)
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            lines = []
            try:
                for line in stream:  # ends when the server cancels the stream
                    lines.append(line)
            except httpx.RemoteProtocolError:  # cut mid-body: exactly what a cancel looks like
                pass
        # uvicorn re-raises the signal after its shutdown, so the exit status is the signal's
        assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert time.monotonic() - started < 30
        assert not any('"type": "done"' in line for line in lines)  # cut, not finished
        assert list((tmp_path / "kv").glob("*/*.kv.safetensors"))
        assert not list((tmp_path / "kv").rglob("*.tmp"))
    finally:
        server.kill()
