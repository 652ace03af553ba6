"""Run `ragcache serve` as a child process and wait until it answers: what the sample chatbot,
`make demo` and the server tests use to start (and always stop) a real sidecar."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

BANNER = re.compile(r"ragcache serving on (http://\S+)")


def parent_death_signal() -> Callable[[], None] | None:
    """A function for the child (between fork and exec) asking Linux to send it SIGTERM when its
    parent dies, so a killed chatbot or test run never leaves a sidecar holding a model. libc is
    loaded here, in the parent: loading a library in a forked child of a threaded process can
    deadlock."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def in_child() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return in_child


class SidecarError(RuntimeError):
    """The sidecar exited or did not become healthy; the message carries the end of its log."""


class ServiceProcess:
    """A child HTTP service that prints a banner with its address once it listens and answers
    `health_path` with 200. Output goes to a file so a full pipe can never stall it."""

    banner_pattern = BANNER
    health_path = "/health"
    what = "the sidecar"

    def __init__(self, args: list[str], log_path: Path, cwd: Path | None = None):
        self.args = args
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.base = ""
        self.banner = ""

    def start(self, timeout_s: float = 300) -> ServiceProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                         preexec_fn=parent_death_signal())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SidecarError(f"{self.what} exited ({self.proc.returncode}):\n{self.log_tail()}")
            match = self.banner_pattern.search(self.log())
            if match:
                self.banner = next(line for line in self.log().splitlines() if self.banner_pattern.search(line))
                self.base = match.group(1).rstrip("/")
                try:
                    if httpx.get(self.base + self.health_path, timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.kill()
        raise SidecarError(f"{self.what} did not start within {timeout_s:.0f}s:\n{self.log_tail()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop(timeout_s=30)
        except subprocess.TimeoutExpired:
            self.kill()


class SidecarProcess(ServiceProcess):
    """A `python -m engine_sidecar.cli serve` child on 127.0.0.1 (port 0: the OS picks a free one,
    the banner tells which)."""

    def __init__(self, log_path: Path, *serve_args: str, port: int = 0, cwd: Path | None = None):
        super().__init__([sys.executable, "-m", "engine_sidecar.cli", "serve", "--port", str(port), *serve_args],
                         log_path, cwd)
