"""Operator settings of one sidecar (the `ragcache serve` flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None  # None: no auth
    max_queue: int = 16  # requests queued + running before 429
    max_chunks: int = 64  # per request
    max_chunk_chars: int = 32_000  # per chunk
    max_chunk_id_chars: int = 256
    max_stop_strings: int = 16
    max_body_bytes: int = 16 << 20  # checked before the body is parsed
    request_timeout_s: float = 600.0  # from arrival, queue wait included
    retry_after_s: int = 1  # what a 429 tells the client to wait
    model_name: str = "ragcache"  # echoed as `model` in OpenAI responses when the client sends none
