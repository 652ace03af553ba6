"""`ragcache serve` as a process: the helper the server tests share, and its start-up behaviour
(banner with the real port, flag errors, a taken port)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine_sidecar.server.process import SidecarError, SidecarProcess


class ServerProcess(SidecarProcess):
    """The product's SidecarProcess with the tests' calling convention and a /metrics reader."""

    def __init__(self, model_dir: Path, cache_dir: Path, log_path: Path, *extra: str, port: int = 0):
        super().__init__(log_path, "--model", str(model_dir), "--cache-dir", str(cache_dir), *extra, port=port,
                         cwd=Path(__file__).resolve().parents[2])

    def start(self, timeout_s: float = 300) -> ServerProcess:
        try:
            super().start(timeout_s)
        except SidecarError as exc:
            raise AssertionError(str(exc)) from exc
        return self

    def metric(self, name: str, **labels: str) -> float:
        """One sample from /metrics (0 if absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0


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


@pytest.mark.parametrize("flag,value", [("--max-queue", "0"), ("--request-timeout", "-1"), ("--max-tokens", "0")])
def test_bad_serve_flags_are_refused_before_the_model_loads(tmp_path, flag, value):
    result = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "serve", "--model", str(tmp_path / "none"),
                             flag, value], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "error:" in result.stderr and flag in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_sidecar_dies_with_its_killed_parent(tiny_llama_dir, tmp_path):
    """SIGKILL leaves no chance to clean up: the kernel's parent-death signal stops the sidecar."""
    parent_code = (
        "import sys, time; from pathlib import Path; from engine_sidecar.server.process import SidecarProcess\n"
        f"s = SidecarProcess(Path({str(tmp_path / 'log')!r}), '--model', {str(tiny_llama_dir)!r}, '--no-disk').start()\n"
        "print(s.proc.pid, flush=True); time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    try:
        child_pid = int(parent.stdout.readline())
        os.kill(child_pid, 0)  # running
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.kill(child_pid, signal.SIGKILL)
        raise AssertionError("the sidecar outlived its killed parent")
    finally:
        if parent.poll() is None:
            parent.kill()
