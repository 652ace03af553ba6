"""Where framework adapters send prompts: an in-process Engine or a `ragcache serve` sidecar.

Both backends have the same surface, so an adapter is written once:

- `generate` / `stream` / `agenerate` / `astream`: a chunk-structured prompt (reuse happens here);
- `chat` / `stream_chat` / `achat` / `astream_chat`: a plain chat, computed in full (the fallback
  when an adapter cannot recover chunks from a prompt that a framework flattened);
- `count_tokens`, `context_window`, `model_name`: offline token counting and model facts.

Streams are iterated for text deltas; `.result` holds the GenerationResult (text, stats) once
iteration has ended. Every call returns its own stream object, so concurrent calls never share
result state.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ragcache_integrations.api_models import WarmResponse
from ragcache_integrations.policy_registry import DEFAULT_POLICY
from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationResult, SamplingParams

Messages = list[dict[str, str]]


class DeltaStream:
    """Text deltas of one generation; `.result` is set when iteration ends (None if cut short)."""

    def __init__(self, deltas: Iterator[str], finish: Callable[[], GenerationResult | None]):
        self._deltas = deltas
        self._finish = finish
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._deltas
        finally:
            # closing the source releases what it holds (the engine lock, an HTTP connection)
            # right away when the consumer stops early, instead of at garbage collection
            close = getattr(self._deltas, "close", None)
            if close is not None:
                close()
        self.result = self._finish()


class AsyncDeltaStream:
    """Async counterpart of DeltaStream."""

    def __init__(self, deltas: AsyncIterator[str], finish: Callable[[], GenerationResult | None]):
        self._deltas = deltas
        self._finish = finish
        self.result: GenerationResult | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for delta in self._deltas:
                yield delta
        finally:
            aclose = getattr(self._deltas, "aclose", None)
            if aclose is not None:
                await aclose()
        self.result = self._finish()


@runtime_checkable
class Backend(Protocol):
    """What adapters need from a model server. Keyword options are the engine's own."""

    @property
    def context_window(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    def count_tokens(self, text: str) -> int: ...

    def generate(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                 order: str = "preserve", tenant: str = "") -> GenerationResult: ...

    def stream(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
               order: str = "preserve", tenant: str = "") -> DeltaStream: ...

    async def agenerate(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                        order: str = "preserve", tenant: str = "") -> GenerationResult: ...

    def astream(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                order: str = "preserve", tenant: str = "") -> AsyncDeltaStream: ...

    def chat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> GenerationResult: ...

    def warm(self, chunks: list[Chunk], system: str | None = None, *, tenant: str = "",
             neighbours: int | None = None) -> WarmResponse: ...

    def stream_chat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> DeltaStream: ...

    async def achat(self, messages: Messages, sampling: SamplingParams, *,
                    tenant: str = "") -> GenerationResult: ...

    def astream_chat(self, messages: Messages, sampling: SamplingParams, *,
                     tenant: str = "") -> AsyncDeltaStream: ...


def _drain(stream: DeltaStream) -> GenerationResult:
    for _ in stream:
        pass
    assert stream.result is not None, "the backend ended a stream without a result"
    return stream.result


async def _adrain(stream: AsyncDeltaStream) -> GenerationResult:
    async for _ in stream:
        pass
    assert stream.result is not None, "the backend ended a stream without a result"
    return stream.result


def _in_thread(make: Callable[[], Any]) -> AsyncDeltaStream:
    """Run a blocking stream in a worker thread and hand its deltas to the event loop.

    The engine computes on the calling thread, so async callers must not run it on the loop.
    If the consumer stops early, the worker is told to stop and closes the engine stream
    (which releases the engine lock) instead of decoding to max_tokens for nobody."""
    holder: dict[str, DeltaStream] = {}

    async def deltas() -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        stop = threading.Event()

        def produce() -> None:
            try:
                stream = holder["stream"] = make()
                iterator = iter(stream)
                try:
                    for delta in iterator:
                        if stop.is_set():
                            break
                        loop.call_soon_threadsafe(queue.put_nowait, ("delta", delta))
                finally:
                    iterator.close()  # type: ignore[attr-defined]
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))

        worker = loop.run_in_executor(None, produce)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "delta":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    break
        finally:
            stop.set()
            await worker

    def finish() -> GenerationResult | None:
        stream = holder.get("stream")
        return stream.result if stream is not None else None

    return AsyncDeltaStream(deltas(), finish)


class EngineBackend:
    """In process (notebooks, tests, single-process apps): calls an `engine_sidecar.Engine`."""

    def __init__(self, engine: Any):
        self.engine = engine

    @property
    def context_window(self) -> int:
        return int(self.engine.max_context)

    @property
    def model_name(self) -> str:
        return str(getattr(self.engine, "model_dir", "ragcache"))

    def count_tokens(self, text: str) -> int:
        return len(self.engine.encode(text))

    def stream(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
               order: str = "preserve", tenant: str = "") -> DeltaStream:
        handle = self.engine.stream(prompt, sampling, policy=policy, tenant=tenant, order=order)
        return DeltaStream(iter(handle), lambda: handle.result)

    def generate(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                 order: str = "preserve", tenant: str = "") -> GenerationResult:
        return _drain(self.stream(prompt, sampling, policy=policy, order=order, tenant=tenant))

    async def agenerate(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                        order: str = "preserve", tenant: str = "") -> GenerationResult:
        return await _adrain(self.astream(prompt, sampling, policy=policy, order=order, tenant=tenant))

    def astream(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                order: str = "preserve", tenant: str = "") -> AsyncDeltaStream:
        return _in_thread(lambda: self.stream(prompt, sampling, policy=policy, order=order, tenant=tenant))

    def warm(self, chunks: list[Chunk], system: str | None = None, *, tenant: str = "",
             neighbours: int | None = None) -> WarmResponse:
        report = self.engine.warm_report(list(chunks), system, tenant, neighbours)
        return WarmResponse(chunks=report.chunks, computed=report.computed, neighbours=report.neighbours,
                            tokens_prefilled=report.tokens_prefilled, seconds=report.seconds)

    def stream_chat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> DeltaStream:
        handle = self.engine.stream_chat(messages, sampling, tenant=tenant)
        return DeltaStream(iter(handle), lambda: handle.result)

    def chat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> GenerationResult:
        return _drain(self.stream_chat(messages, sampling, tenant=tenant))

    async def achat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> GenerationResult:
        return await _adrain(self.astream_chat(messages, sampling, tenant=tenant))

    def astream_chat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> AsyncDeltaStream:
        return _in_thread(lambda: self.stream_chat(messages, sampling, tenant=tenant))


class HttpBackend:
    """A `ragcache serve` sidecar, through `ragcache_integrations.client`.

    Each call opens its own client (one connection), so concurrent calls from threads or event
    loops never share result state or a connection pool bound to another loop.

    `timeout` is one deadline for each call as a whole, a stream to its last token included.

    Token counting stays offline: `tokenizer` is a local HF tokenizer folder or object; without
    it, the folder the sidecar reports in /health is used when it exists on this machine, else
    a rough estimate (4 characters per token)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0, retries: int = 3,
                 tokenizer: Any = None, context_window: int | None = None, headers: Mapping[str, str] | None = None):
        try:
            from ragcache_integrations import client
        except ImportError as exc:  # the module, or httpx it needs
            raise RuntimeError(
                "base_url= needs ragcache_integrations.client (the HTTP client of `ragcache serve`), which "
                f"could not be imported ({exc}); install ragcache with httpx, or pass engine= instead"
            ) from exc
        self._client_module = client
        self.base_url = base_url
        self._options: dict[str, Any] = {"api_key": api_key, "timeout": timeout, "retries": retries,
                                         "headers": dict(headers or {})}
        self._tokenizer = tokenizer
        self._context_window = context_window
        self._model_name: str | None = None
        self._facts_loaded = False

    # --- model facts, looked up lazily until a lookup succeeds (a sidecar may start after the app)
    def _load_facts(self) -> None:
        if self._facts_loaded:
            return
        try:
            with self._client_module.RagCacheClient(self.base_url, **self._options) as c:
                health = c.health()
        except Exception:  # not up yet: the next call asks again; generation reports a real error if any
            return
        self._facts_loaded = True
        self._model_name = health.model
        if self._context_window is None:
            self._context_window = health.context_window
        folder = Path(health.model_path)  # usable when the sidecar runs on this machine
        if self._tokenizer is None and (folder / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    @property
    def context_window(self) -> int:
        self._load_facts()
        return self._context_window or 2048

    @property
    def model_name(self) -> str:
        self._load_facts()
        return self._model_name or "ragcache"

    def count_tokens(self, text: str) -> int:
        self._load_facts()
        if isinstance(self._tokenizer, str | Path):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self._tokenizer), local_files_only=True)
        if self._tokenizer is None:
            return max(1, len(text) // 4)
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    # --- generation -------------------------------------------------------------------------
    def stream(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
               order: str = "preserve", tenant: str = "") -> DeltaStream:
        client = self._client_module.RagCacheClient(self.base_url, **self._options)

        def deltas() -> Iterator[str]:
            with client:
                yield from client.stream(prompt, sampling, policy=policy, order=order, tenant=tenant or None)

        return DeltaStream(deltas(), lambda: client.last_result)

    def generate(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                 order: str = "preserve", tenant: str = "") -> GenerationResult:
        with self._client_module.RagCacheClient(self.base_url, **self._options) as client:
            return client.generate(prompt, sampling, policy=policy, order=order, tenant=tenant or None)

    def astream(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                order: str = "preserve", tenant: str = "") -> AsyncDeltaStream:
        client = self._client_module.AsyncRagCacheClient(self.base_url, **self._options)

        async def deltas() -> AsyncIterator[str]:
            async with client:
                async for delta in client.stream(prompt, sampling, policy=policy, order=order,
                                                 tenant=tenant or None):
                    yield delta

        return AsyncDeltaStream(deltas(), lambda: client.last_result)

    async def agenerate(self, prompt: ChunkedPrompt, sampling: SamplingParams, *, policy: str = DEFAULT_POLICY,
                        order: str = "preserve", tenant: str = "") -> GenerationResult:
        async with self._client_module.AsyncRagCacheClient(self.base_url, **self._options) as client:
            return await client.generate(prompt, sampling, policy=policy, order=order, tenant=tenant or None)

    def warm(self, chunks: list[Chunk], system: str | None = None, *, tenant: str = "",
             neighbours: int | None = None) -> WarmResponse:
        with self._client_module.RagCacheClient(self.base_url, **self._options) as client:
            return client.warm(list(chunks), system, tenant or None, neighbours)

    # --- plain chat (no chunks) -------------------------------------------------------------
    # A plain chat is a verbatim-layout prompt without chunks, computed in full: the same tokens
    # the sidecar's chat endpoint would compute, with streaming and stats like any generation.
    def stream_chat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> DeltaStream:
        return self.stream(ChunkedPrompt(messages=messages), sampling, policy="full", tenant=tenant)

    def chat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> GenerationResult:
        return self.generate(ChunkedPrompt(messages=messages), sampling, policy="full", tenant=tenant)

    async def achat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> GenerationResult:
        return await self.agenerate(ChunkedPrompt(messages=messages), sampling, policy="full", tenant=tenant)

    def astream_chat(self, messages: Messages, sampling: SamplingParams, *, tenant: str = "") -> AsyncDeltaStream:
        return self.astream(ChunkedPrompt(messages=messages), sampling, policy="full", tenant=tenant)


BASE_URL_ENV, API_KEY_ENV = "RAGCACHE_BASE_URL", "RAGCACHE_API_KEY"


def sidecar_address(engine: Any, base_url: str | None, api_base: str | None = None,
                    api_key: str | None = None) -> tuple[str | None, str | None]:
    """(base URL, API key) an adapter was given: `base_url` or `api_base` (OpenAI clients' name),
    else $RAGCACHE_BASE_URL when no engine is given; the key, else $RAGCACHE_API_KEY."""
    if base_url is not None and api_base is not None and base_url != api_base:
        raise ValueError(f"base_url={base_url!r} and api_base={api_base!r} disagree: give one of them")
    url = base_url or api_base
    if url is None and engine is None:
        url = os.environ.get(BASE_URL_ENV) or None
    return url, api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def make_backend(engine: Any = None, base_url: str | None = None, api_key: str | None = None,
                 **http_options: Any) -> Backend:
    """The backend for an adapter's `engine=` / `base_url=` arguments (exactly one of them)."""
    if (engine is None) == (base_url is None):
        raise ValueError(f"give exactly one of engine= (an in-process Engine) or base_url= (a sidecar URL, also "
                         f"read from ${BASE_URL_ENV})")
    if engine is not None:
        if http_options.get("headers"):
            raise ValueError("default_headers go with requests to a sidecar (base_url=); an in-process engine= "
                             "sends none")
        return EngineBackend(engine)
    assert base_url is not None
    return HttpBackend(base_url, api_key=api_key, **http_options)


SAMPLING_OPTIONS = tuple(SamplingParams.model_fields)


def check_sampling_options(options: Mapping[str, Any] | None, setting: str) -> dict[str, Any]:
    """An adapter's extra sampling options (OpenAI clients' `additional_kwargs` / `model_kwargs`),
    checked when the adapter is built: an option the engine does not know is an error naming the
    ones it does, never dropped."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(SAMPLING_OPTIONS))
    if unknown:
        raise ValueError(f"{setting} has {', '.join(map(repr, unknown))}, which ragcache does not know; "
                         f"it takes {', '.join(SAMPLING_OPTIONS)}")
    SamplingParams(**options)  # values out of range fail here too
    return options


class LastCallMixin:
    """`.backend`, `.last_stats`, `.last_prompt` for adapters that keep them as private fields."""

    _backend: Backend
    _last_stats: dict[str, Any]
    _last_prompt: ChunkedPrompt | None

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def last_stats(self) -> dict[str, Any]:
        """Engine stats of the last call (chunk_hits, chunk_misses, tokens_reused, ttft_s, ...)."""
        return self._last_stats

    @property
    def last_prompt(self) -> ChunkedPrompt | None:
        """The ChunkedPrompt the last call sent; None when it went out as a plain chat."""
        return self._last_prompt


# the stats keys every adapter promises in `.last_stats` and in response metadata
STATS_KEYS = ("chunk_hits", "chunk_misses", "tokens_reused", "tokens_recomputed", "ttft_s")


def usage_counts(stats: Mapping[str, Any]) -> tuple[int, int, int]:
    """(prompt tokens, generated tokens, prompt tokens read from the cache) of a call's stats.

    Read from the cache means `tokens_reused`: prompt tokens whose KV came from the cache and was
    used as is. Cached tokens the policy recomputed are not counted, as their KV was computed
    again; OpenAI's `cached_tokens` and LangChain's `cache_read` mean the same: work not done."""
    prompt = int(stats.get("prefill_tokens_total") or 0)
    return prompt, int(stats.get("decode_tokens") or 0), int(stats.get("tokens_reused") or 0)


def stats_dict(result: GenerationResult | None, **extra: Any) -> dict[str, Any]:
    """A result's stats as a plain dict (JSON-able), plus adapter facts such as `chunks_sent`."""
    stats = result.stats.model_dump() if result is not None else {}
    if result is not None:
        stats["finish_reason"] = result.finish_reason  # "length": cut at max_tokens
    stats.update(extra)
    return stats
