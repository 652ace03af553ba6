"""LlamaIndex `ChunkCachedLLM`: a full LLM over a ragcache engine, a drop-in for any query engine.

`index.as_query_engine(llm=ChunkCachedLLM(engine=...))` works unchanged. The synthesizers hand
the LLM a flattened prompt; the LLM recovers the chunk structure by locating the nodes the
current query retrieved (seen through LlamaIndex instrumentation, see `observer.py`) in the
prompt text, and sends system | chunks | question to the engine, so every retrieved node's KV is
reused across queries. A prompt where no retrieved node is found (or of a shape a ChunkedPrompt
cannot hold, e.g. earlier chat turns) is sent as a plain chat, exactly as given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, field_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from ragcache_integrations.api_models import Order
from ragcache_integrations.backend import (
    SAMPLING_OPTIONS,
    AsyncDeltaStream,
    Backend,
    DeltaStream,
    LastCallMixin,
    check_sampling_options,
    make_backend,
    sidecar_address,
    stats_dict,
    usage_counts,
)
from ragcache_integrations.llama_index import observer
from ragcache_integrations.policy_registry import DEFAULT_POLICY, check_policy, forms_text
from ragcache_integrations.recovery import REGISTRY, Recovery, normalize_messages, to_chunked_prompt
from ragcache_integrations.types import ChunkedPrompt, GenerationResult, SamplingParams


def as_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role.value, "content": m.content or ""} for m in messages]


def response_extras(stats: dict[str, Any]) -> dict[str, Any]:
    """A response's `raw` and `additional_kwargs`: the token usage as LlamaIndex's OpenAI LLM
    reports it (`raw["usage"]`, which token counting handlers read, and flat counts in
    `additional_kwargs`), with the prompt tokens read from the cache as `cached_tokens`, and the
    engine stats under "ragcache"."""
    prompt, completion, cached = usage_counts(stats)
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {"raw": {"usage": {**counts, "prompt_tokens_details": {"cached_tokens": cached}}},
            "additional_kwargs": {**counts, "cached_tokens": cached, "ragcache": stats}}


def _plain_roles(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    # chat templates know system/user/assistant; LlamaIndex also has developer/chatbot/model.
    # The same mapping as the chunked path, so both render the same prompt text.
    return normalize_messages(messages) or messages


class ChunkCachedLLM(LastCallMixin, LLM):
    """LLM with chunk-level KV reuse. Give exactly one of `engine=` (an in-process
    `engine_sidecar.Engine`) or `base_url=` (a `ragcache serve` sidecar).

    `.last_stats` holds the engine stats of the last call (also in each response's
    `additional_kwargs["ragcache"]`, next to the token usage, see `response_extras`),
    `.last_prompt` the ChunkedPrompt it sent (None when the call went out as a plain chat;
    `.last_stats["fallback_reason"]` says why)."""

    policy: str = Field(default=DEFAULT_POLICY, description=f"Recompute policy: {forms_text()}")
    order: Order = Field(default="preserve", description="preserve; frequency (the engine sorts chunks by access "
                         "count); hits-first / misses-first (chunks the engine holds before / after new ones)")
    tenant: str = Field(default="", description="Salts every cache key: tenants never share KV")
    conversation_id: str | None = Field(
        default=None, description="Keep this chat's KV: the next call reuses the turns it repeats exactly")
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    recover_chunks: bool = Field(default=True, description="Look for retrieved nodes in flattened prompts")
    min_chunk_chars: int = Field(default=16, ge=1, description="Shorter node texts are not matched")
    context_window: int | None = Field(default=None, description="Default: the model's context window")
    model: str | None = Field(default=None, description="Label only (metadata, traces): the sidecar serves one "
                              "model, whose name is used when this is left out")
    timeout: float = Field(default=600.0, gt=0, description="Seconds for each sidecar call as a whole (one "
                           "deadline: retries and streaming included)")
    max_retries: int = Field(default=3, ge=0, description="Sidecar retries on 429/503 and connect "
                             "timeouts, each only when it can start before the deadline")
    default_headers: dict[str, str] | None = Field(default=None, description="Headers sent with every sidecar "
                                                   "request (a gateway's, a trace id)")
    additional_kwargs: dict[str, Any] = Field(default_factory=dict, description="More sampling options for every "
                                              "call (e.g. stop_token_ids, ignore_eos); they override the fields")

    # an unknown setting (a typo, an OpenAI option this class lacks) is an error, never dropped
    model_config = ConfigDict(extra="forbid")

    # a typo fails at construction, naming the valid forms, not at the first request
    _policy = field_validator("policy")(classmethod(lambda cls, v: check_policy(v)))
    _extra_sampling = field_validator("additional_kwargs")(
        classmethod(lambda cls, v: check_sampling_options(v, "additional_kwargs")))

    _backend: Backend = PrivateAttr()
    _last_stats: dict[str, Any] = PrivateAttr(default_factory=dict)
    _last_prompt: ChunkedPrompt | None = PrivateAttr(default=None)

    def __init__(self, *, engine: Any = None, base_url: str | None = None, api_base: str | None = None,
                 api_key: str | None = None, tokenizer: Any = None, **fields: Any):
        """`base_url` (or `api_base`, OpenAILike's name; else $RAGCACHE_BASE_URL) for a sidecar,
        `api_key` (else $RAGCACHE_API_KEY); or `engine=` for an in-process Engine."""
        super().__init__(**fields)
        url, key = sidecar_address(engine, base_url, api_base, api_key)
        http = {"timeout": self.timeout, "retries": self.max_retries, "tokenizer": tokenizer,
                "headers": self.default_headers}
        self._backend = make_backend(engine, url, key, **(http if url is not None else {"headers": self.default_headers}))
        observer.install()

    @classmethod
    def class_name(cls) -> str:
        return "ChunkCachedLLM"

    # --- facts --------------------------------------------------------------------------------
    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window or self._backend.context_window,
                           num_output=self.max_tokens, is_chat_model=True, is_function_calling_model=False,
                           model_name=self.model or self._backend.model_name)

    @property
    def tokenizer(self) -> Callable[[str], list[int]]:
        """For `Settings.tokenizer`, which LlamaIndex only measures with len(): counts tokens the
        way the model does, offline (LlamaIndex's default is a GPT tokenizer)."""
        return lambda text: list(range(self._backend.count_tokens(text)))

    def count_tokens(self, text: str) -> int:
        return self._backend.count_tokens(text)

    def sampling(self, **overrides: Any) -> SamplingParams:
        params = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "stop": self.stop, "seed": self.seed, **self.additional_kwargs}
        params.update({k: v for k, v in overrides.items() if k in SAMPLING_OPTIONS and v is not None})
        return SamplingParams(**params)

    # --- the decision: chunked or plain ----------------------------------------------------------
    def plan(self, messages: list[dict[str, str]]) -> Recovery:
        """The ChunkedPrompt these messages become, or why they stay a plain chat."""
        if not self.recover_chunks:
            return Recovery(None, "chunk recovery is off")
        return to_chunked_prompt(messages, REGISTRY.snapshot(), min_chars=self.min_chunk_chars,
                                 conversation_id=self.conversation_id)

    def _record(self, result: GenerationResult | None, recovery: Recovery) -> dict[str, Any]:
        chunks = len(recovery.prompt.chunks) if recovery.prompt is not None else 0
        self._last_stats = stats_dict(result, chunks_sent=chunks, fallback_reason=recovery.reason or None)
        self._last_prompt = recovery.prompt
        return self._last_stats

    def _open(self, messages: list[dict[str, str]], sampling: SamplingParams) -> tuple[DeltaStream, Recovery]:
        recovery = self.plan(messages)
        if recovery.prompt is not None:
            return self.stream_chunked(recovery.prompt, sampling), recovery
        if self.conversation_id:  # no passages, but the chat's earlier turns can still be reused
            return self.stream_chunked(self._unchunked(messages), sampling), recovery
        return self._backend.stream_chat(_plain_roles(messages), sampling, tenant=self.tenant), recovery

    def _aopen(self, messages: list[dict[str, str]], sampling: SamplingParams) -> tuple[AsyncDeltaStream, Recovery]:
        recovery = self.plan(messages)
        if recovery.prompt is not None:
            return self.astream_chunked(recovery.prompt, sampling), recovery
        if self.conversation_id:
            return self.astream_chunked(self._unchunked(messages), sampling), recovery
        return self._backend.astream_chat(_plain_roles(messages), sampling, tenant=self.tenant), recovery

    def _unchunked(self, messages: list[dict[str, str]]) -> ChunkedPrompt:
        return ChunkedPrompt(messages=_plain_roles(messages), conversation_id=self.conversation_id)

    # --- structured entry points (used by ChunkCachedSynthesizer) -----------------------------
    def stream_chunked(self, prompt: ChunkedPrompt, sampling: SamplingParams | None = None) -> DeltaStream:
        return self._backend.stream(prompt, sampling or self.sampling(), policy=self.policy, order=self.order,
                                    tenant=self.tenant)

    def astream_chunked(self, prompt: ChunkedPrompt, sampling: SamplingParams | None = None) -> AsyncDeltaStream:
        return self._backend.astream(prompt, sampling or self.sampling(), policy=self.policy, order=self.order,
                                     tenant=self.tenant)

    def record_chunked(self, prompt: ChunkedPrompt, result: GenerationResult | None) -> dict[str, Any]:
        return self._record(result, Recovery(prompt))

    # --- chat ---------------------------------------------------------------------------------
    def _chat_messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
        return as_dicts(messages)

    def _completion_messages(self, prompt: str, formatted: bool) -> list[dict[str, str]]:
        # formatted=True: LlamaIndex already put system_prompt into the text (LLM._extend_prompt)
        system = [] if formatted or not self.system_prompt else [{"role": "system", "content": self.system_prompt}]
        return [*system, {"role": "user", "content": prompt}]

    def _run(self, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        stream, recovery = self._open(messages, self.sampling(**kwargs))
        text = "".join(stream)
        return text, self._record(stream.result, recovery)

    async def _arun(self, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        stream, recovery = self._aopen(messages, self.sampling(**kwargs))
        text = "".join([d async for d in stream])
        return text, self._record(stream.result, recovery)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        text, stats = self._run(self._chat_messages(messages), kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                            **response_extras(stats))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream, recovery = self._open(self._chat_messages(messages), self.sampling(**kwargs))

        def gen() -> ChatResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            # stats exist only once the engine is done: they ride on a last, empty delta
            stats = self._record(stream.result, recovery)
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta="",
                               **response_extras(stats))

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        text, stats = await self._arun(self._chat_messages(messages), kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                            **response_extras(stats))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream, recovery = self._aopen(self._chat_messages(messages), self.sampling(**kwargs))

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            stats = self._record(stream.result, recovery)
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta="",
                               **response_extras(stats))

        return gen()

    # --- completion ---------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, stats = self._run(self._completion_messages(prompt, formatted), kwargs)
        return CompletionResponse(text=text, **response_extras(stats))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream, recovery = self._open(self._completion_messages(prompt, formatted), self.sampling(**kwargs))

        def gen() -> CompletionResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            stats = self._record(stream.result, recovery)
            yield CompletionResponse(text=text, delta="", **response_extras(stats))

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, stats = await self._arun(self._completion_messages(prompt, formatted), kwargs)
        return CompletionResponse(text=text, **response_extras(stats))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        stream, recovery = self._aopen(self._completion_messages(prompt, formatted), self.sampling(**kwargs))

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            stats = self._record(stream.result, recovery)
            yield CompletionResponse(text=text, delta="", **response_extras(stats))

        return gen()
