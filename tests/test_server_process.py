"""`ragcache serve` as a process: the helper the server tests share, and its start-up behaviour
(banner with the real port, flag errors, a taken port)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

BANNER = re.compile(r"ragcache serving on (http://\S+)")


class ServerProcess:
    """A `python -m engine_sidecar.cli serve` child on 127.0.0.1 (port 0: the OS picks a free one,
    the banner tells which). Output goes to a file so a full pipe can never stall the server."""

    def __init__(self, model_dir: Path, cache_dir: Path, log_path: Path, *extra: str, port: int = 0):
        self.args = [sys.executable, "-m", "engine_sidecar.cli", "serve", "--model", str(model_dir),
                     "--port", str(port), "--cache-dir", str(cache_dir), *extra]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.base = ""
        self.banner = ""

    def start(self, timeout_s: float = 300) -> ServerProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=Path(__file__).resolve().parents[1])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            match = BANNER.search(self.log())
            if match:
                self.banner = next(line for line in self.log().splitlines() if BANNER.search(line))
                self.base = match.group(1)
                if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                    return self
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"server did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        """One sample from /metrics (0 if absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop(timeout_s=30)
        except subprocess.TimeoutExpired:
            self.kill()


def test_port_zero_banner_names_the_real_address_model_device_dtype_and_tiers(tiny_llama_dir, tmp_path):
    with ServerProcess(tiny_llama_dir, tmp_path / "kv", tmp_path / "log", "--ram-cache-gb", "0.5") as server:
        port = int(server.base.rsplit(":", 1)[1])
        assert port > 0 and server.base == f"http://127.0.0.1:{port}"
        for part in (f"model {tiny_llama_dir}", "device cpu", "dtype float32", "RAM 0.5 GiB",
                     f"disk {tmp_path / 'kv'}", "auth off"):
            assert part in server.banner, server.banner


def test_taken_port_fails_fast_and_says_why(tiny_llama_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(tiny_llama_dir, tmp_path / "kv", tmp_path / "log", port=port)
        with pytest.raises(AssertionError, match="address already in use|error while attempting to bind"):
            server.start()
        assert server.proc is not None and server.proc.returncode != 0


@pytest.mark.parametrize("flag,value", [("--max-queue", "0"), ("--request-timeout", "-1")])
def test_bad_serve_flags_are_refused_before_the_model_loads(tmp_path, flag, value):
    result = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "serve", "--model", str(tmp_path / "none"),
                             flag, value], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "ragcache: error:" in result.stderr and flag in result.stderr
