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
    # generation holds back up to the longest stop string's length of text, and the engine only
    # notices a cancellation (timeout, disconnect) when it emits text: keep that window short
    max_stop_chars: int = 256
    max_tokens: int = 4096  # the largest max_tokens a request may ask for; also caps the defaults
    max_body_bytes: int = 16 << 20  # checked before the body is parsed
    request_timeout_s: float = 600.0  # from arrival to the last byte, queue wait included, streamed or not
    retry_after_s: int = 1  # what a 429 tells the client to wait
    model_name: str = "ragcache"  # echoed as `model` in OpenAI responses when the client sends none
    # passages remembered per tenant (warmed or sent as chunks) and looked for in plain chats; 0: off
    remember_passages: int = 4096
