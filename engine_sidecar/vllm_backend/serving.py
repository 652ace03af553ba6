"""`ragcache serve --engine vllm`: the sidecar's API in front of vLLM's OpenAI server, which runs
ragcache's KV connector (engine_sidecar/vllm_backend).

A chunk-structured request is laid out by ragcache's PromptBuilder (layout.py) and sent to
vLLM's `/v1/completions` as token ids, with `kv_transfer_params = request_params(prompt, policy,
tenant)` and `cache_salt = tenant`: the connector supplies the KV of the leading chunks it holds
(fused by the policy), vLLM computes the rest and decodes. The answer is streamed back as the
engine's own generations are (deltas, then a GenerationResult), so every route, limit, timeout
and disconnect rule of the sidecar applies unchanged. vLLM is always asked to stream: a client
that leaves closes the stream, and vLLM aborts the request at its next token."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from engine_sidecar.engine.warm import WarmReport
from engine_sidecar.errors import PromptTooLongError
from engine_sidecar.server.backend import EngineFacts, Event
from engine_sidecar.server.errors import ApiError
from engine_sidecar.vllm_backend.launch import VllmProcess
from engine_sidecar.vllm_backend.layout import Laid, VllmLayout
from engine_sidecar.vllm_backend.params import request_params
from engine_sidecar.vllm_backend.stats import ConnectorStats, vllm_request_stats
from ragcache_integrations.api_models import CacheStats
from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationResult, SamplingParams

SERVED_NAME = "ragcache-vllm"
# the question-driven policies (focus, prophet, mix, gate) and Cache-Craft's early termination
# read the question's attention over the reused chunks; here vLLM computes the question
VLLM_POLICIES = ("full", "prefix", "reuse", "cacheblend", "epic", "cachetune")


class VllmBackend:
    name = "vllm"

    def __init__(self, process: VllmProcess, layout: VllmLayout, stats: ConnectorStats, dtype: str,
                 ram_cache_gb: float, request_timeout_s: float, max_queue: int):
        self.process, self.layout, self.stats, self.dtype = process, layout, stats, dtype
        self.ram_cache_gb = ram_cache_gb
        self.client = httpx.Client(base_url=process.url, timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                   limits=httpx.Limits(max_connections=max_queue + 2))
        self._hits = self._misses = 0  # chunk lookups the connector reported (GET /v1/cache/stats)

    # --- facts and checks ---------------------------------------------------------------------
    def store_facts(self) -> None:
        return None  # the chunk store lives in vLLM's worker process

    def store_stats(self) -> None:
        return None

    def kv_rows(self) -> None:
        return None  # vLLM's scheduler holds the request KV

    def facts(self) -> EngineFacts:
        self._check_alive()
        model = self.process.model_dir
        return EngineFacts(model.name, str(model), self.process.max_model_len, "cpu", self.dtype)

    def check_policy(self, policy: str) -> None:
        name = policy.split(":", 1)[0]
        if name not in VLLM_POLICIES:
            raise ApiError(422, f"policy: '{name}' cannot run with --engine vllm (it reads the question's attention "
                                f"over the reused chunks, and vLLM computes the question here); use one of "
                                f"{', '.join(VLLM_POLICIES)}", "policy", "policy_unsupported_by_engine")

    def _check_alive(self) -> None:
        if not self.process.alive():
            raise ApiError(503, f"the vLLM engine exited (code {self.process.returncode}); see "
                                f"{self.process.log_path}; restart the sidecar", None, "engine_unavailable")

    # --- generation ---------------------------------------------------------------------------
    def generate(self, prompt: ChunkedPrompt, sampling: SamplingParams, policy: str, tenant: str,
                 order: str) -> Iterator[Event]:
        t0 = time.perf_counter()
        laid = self.layout.lay_out(self.layout.arrange(prompt, tenant, order), tenant)
        # misses-first puts the new chunks where no leading run of stored ones could start: the
        # connector then supplies every chunk, computing the new ones in place (supply="all")
        supply = "all" if order == "misses-first" else "hits"
        params = request_params(laid.prompt, policy, tenant, supply) if laid.prompt is not None else None
        return self._complete(laid, sampling, params, policy, t0)

    def chat(self, messages: list[dict[str, str]], sampling: SamplingParams, tenant: str) -> Iterator[Event]:
        t0 = time.perf_counter()
        ids = self.layout.builder.build_chat(messages).token_ids
        return self._complete(Laid(ids, None, tenant), sampling, None, "full", t0)

    def neighbour_pool(self, chunks: list[Chunk], neighbours: int | None) -> tuple[int, Callable[[], Any]]:
        if not neighbours:  # unset too: vLLM computes each chunk alone here
            return 0, lambda: None
        raise ApiError(422, "neighbours: warming after neighbours is not available with --engine vllm (vLLM "
                            "computes the chunks here); leave it at 0", "neighbours", "neighbours_unsupported_by_engine")

    def warm(self, chunks: list[Chunk], system: str | None, tenant: str, neighbours: int = 0,
             pool: Any = None) -> WarmReport:
        """Through the connector: each chunk in a one-token request of its own, so vLLM computes
        it and the connector keeps it (in context, after the template prefix)."""
        started = time.perf_counter()
        computed = tokens = 0
        for chunk in chunks:
            prompt = ChunkedPrompt(chunks=[chunk], question="warm", **({"system": system} if system else {}))
            laid = self.layout.lay_out(prompt, tenant)
            # any reusing policy: under `full` the connector's engine keeps nothing
            params = request_params(prompt, "cacheblend", tenant)
            *_, result = self._complete(laid, SamplingParams(max_tokens=1), params, "cacheblend", time.perf_counter())
            computed += result.stats.chunk_misses
            if result.stats.chunk_misses:
                tokens += result.stats.prefill_tokens_total - result.stats.tokens_reused
        return WarmReport(len(chunks), computed, 0, tokens, time.perf_counter() - started)

    def _complete(self, laid: Laid, sampling: SamplingParams, params: dict[str, Any] | None, policy: str,
                  t0: float) -> Iterator[Event]:
        total, window = len(laid.token_ids), self.process.max_model_len
        if total + sampling.max_tokens > window:
            raise PromptTooLongError(f"prompt has {total} tokens and max_tokens is {sampling.max_tokens}: together "
                                     f"more than vLLM's context window ({window}, --max-model-len); send fewer or "
                                     "shorter chunks or lower max_tokens")
        rid = uuid.uuid4().hex
        body = _body(laid, sampling, params)
        laid_s = time.perf_counter() - t0
        ttft, answer, text, finish, usage = None, [], [], "length", {}
        with self._stream(body, rid) as events:
            for event in events:
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and ttft is None:
                        ttft = time.perf_counter() - t0
                    answer += ids
                    text.append(choice.get("text") or "")
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                        if finish == "stop" and not isinstance(choice.get("stop_reason"), str) and answer:
                            answer.pop()  # the EOS / stop token: the engine's results leave it out too
                    yield text[-1]
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        connector = self.stats.take(f"cmpl-{rid}-") if params is not None else None
        if connector is not None:
            self._hits += int(connector.get("chunk_hits") or 0)
            self._misses += int(connector.get("chunks") or 0) - int(connector.get("chunk_hits") or 0)
        details = usage.get("prompt_tokens_details") or {}
        times = {"tokenize_s": laid_s, "vllm_first_token_s": ttft - laid_s,
                 "decode_s": time.perf_counter() - t0 - ttft}
        stats = vllm_request_stats(policy, int(usage.get("prompt_tokens") or total),
                                   int(details.get("cached_tokens") or 0), connector, ttft, len(answer), times,
                                   laid.history)
        self.layout.remember(laid, answer)
        yield GenerationResult(text="".join(text), token_ids=answer, finish_reason=finish, stats=stats)

    @contextmanager
    def _stream(self, body: dict[str, Any], rid: str) -> Iterator[Iterator[dict[str, Any]]]:
        """vLLM's completion stream as parsed events; vLLM's refusals and a dead or silent vLLM
        become HTTP errors. Leaving the block closes the stream (vLLM aborts the request)."""
        self._check_alive()
        try:
            with self.client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}) as response:
                if response.status_code != 200:
                    raise _refusal(response)
                yield _events(response)
        except httpx.TransportError as exc:
            self._check_alive()
            raise ApiError(503, f"the vLLM engine did not answer ({type(exc).__name__}: {exc})", None,
                           "engine_unavailable") from None

    # --- operator routes ----------------------------------------------------------------------
    def clear_cache(self, chunk_id: str | None, tenant: str | None) -> int:
        raise ApiError(501, "deleting chunk KV is not supported with --engine vllm: the chunks live in vLLM's process "
                            "(ragcache's connector), which has no delete call; restart the sidecar to drop them",
                       None, "not_supported_by_engine")

    def cache_stats(self) -> CacheStats:
        """What this sidecar learned from the connector's per-request reports: chunk hits and
        misses; the store's entries and bytes are inside vLLM's process and not visible here."""
        return CacheStats(hits_ram=self._hits, misses=self._misses,
                          ram_capacity_bytes=int(self.ram_cache_gb * (1 << 30)), conversations=self.layout.conversations)

    def close(self) -> None:
        self.client.close()
        self.process.stop()


def _body(laid: Laid, sampling: SamplingParams, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": laid.token_ids, "max_tokens": sampling.max_tokens,
                            "temperature": sampling.temperature, "top_p": sampling.top_p, "stream": True,
                            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if sampling.stop:
        body["stop"] = sampling.stop
    if sampling.stop_token_ids:
        body["stop_token_ids"] = sampling.stop_token_ids
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if laid.tenant:  # vLLM's own prefix cache stays apart per tenant too
        body["cache_salt"] = laid.tenant
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:  # vLLM reports a failure after the first token in the stream
            raise ApiError(503, f"vLLM failed mid-answer: {event['error'].get('message', event['error'])}", None,
                           "engine_error")
        yield event


def _refusal(response: httpx.Response) -> ApiError:
    response.read()
    try:
        message = response.json().get("error", {}).get("message") or response.text
    except ValueError:
        message = response.text
    status = 400 if 400 <= response.status_code < 500 else 503
    return ApiError(status, f"vLLM refused the request: {message}"[:500], None, "engine_refused")
