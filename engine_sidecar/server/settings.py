"""Operator settings of one sidecar. Those an operator sets carry their `ragcache serve` flag,
from which the flags are generated (serve_args.py): each is written once, here."""

from __future__ import annotations

from dataclasses import dataclass

from engine_sidecar.engine_config import MIB, Flag, setting


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = setting(None, Flag("--api-key", "require 'Authorization: Bearer KEY' (default: "
                                                          "$RAGCACHE_API_KEY, else no auth)"))
    max_queue: int = setting(16, Flag("--max-queue", "requests queued + running before 429", parse="positive"))
    max_chunks: int = setting(64, Flag("--max-chunks", "chunks per request", parse="positive"))
    max_chunk_chars: int = setting(32_000, Flag("--max-chunk-chars", "characters per chunk", parse="positive"))
    max_chunk_id_chars: int = 256
    max_stop_strings: int = 16
    # generation holds back up to the longest stop string's length of text, and the engine only
    # notices a cancellation (timeout, disconnect) when it emits text: keep that window short
    max_stop_chars: int = 256
    # also caps the defaults
    max_tokens: int = setting(4096, Flag("--max-tokens", "largest max_tokens a request may ask for", parse="positive"))
    max_body_bytes: int = setting(16 << 20, Flag("--max-body-mb", "request body size in MiB, checked before the body "
                                                 "is parsed", parse="above_zero", unit=MIB))
    request_timeout_s: float = setting(600.0, Flag("--request-timeout", "seconds per request from arrival to its "
                                                   "last byte, queue wait included, streamed or not",
                                                   parse="above_zero"))
    retry_after_s: int = 1  # what a 429 tells the client to wait
    model_name: str = "ragcache"  # echoed as `model` in OpenAI responses when the client sends none
    remember_passages: int = setting(4096, Flag(
        "--remember-passages", "passages remembered per tenant (warmed, or sent as chunks) and found in plain chat "
        "messages, so an OpenAI app that quotes them gets their KV reused (0: off)", parse="whole"))
    passage_memory_bytes: int = setting(256 << 20, Flag(
        "--passage-memory-mb", "MiB of passage texts remembered for all tenants together; past it the tenant "
        "holding the most gives up its oldest first, so a tenant within its fair share keeps its passages",
        parse="non_negative", unit=MIB))
