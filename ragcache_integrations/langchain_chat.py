"""LangChain `ChunkCachedChatModel`: a chat model over a ragcache engine, for chains that format
their own prompt (`prompt | llm`, `create_stuff_documents_chain(llm, prompt)`, agents' chat steps).

It recovers chunk structure the way the LlamaIndex drop-in does: documents any retriever in the
process returned are seen through a LangChain callback hook (`langchain_observer.py`), and where
their exact text occurs in the messages they become chunks of a verbatim-layout prompt. The
model then computes exactly the tokens a plain chat model would, reusing the documents' KV.
Messages without a known document go out as a plain chat. Tool calling, structured output and
multimodal inputs are not supported (SmolLM2-class models have no tool format); passing them
is a clear error, not a silent drop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, NoReturn, get_args

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from ragcache_integrations import langchain_observer
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
from ragcache_integrations.policy_registry import DEFAULT_POLICY, check_policy, forms_text
from ragcache_integrations.recovery import REGISTRY, Recovery, to_chunked_prompt
from ragcache_integrations.types import ChunkedPrompt, GenerationResult, SamplingParams

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "developer": "system"}


def _text_of(message: BaseMessage, index: int) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"messages[{index}] has a {kind!r} content block; ChunkCachedChatModel takes text only")
    return "".join(parts)


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as {role, content} for the model's chat template."""
    out = []
    for i, m in enumerate(messages):
        role = _ROLES.get(m.type) or (str(getattr(m, "role", "")) if m.type == "chat" else None)
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}] is a {m.type!r} message; ChunkCachedChatModel takes system, "
                             "human and ai messages (tool calling is not supported)")
        if isinstance(m, AIMessage) and m.tool_calls:
            raise ValueError(f"messages[{i}] carries tool calls; tool calling is not supported")
        out.append({"role": role, "content": _text_of(m, i)})
    return out


class ChunkCachedChatModel(LastCallMixin, BaseChatModel):
    """Chat model with chunk-level KV reuse. Give exactly one of `engine=` (an in-process
    `engine_sidecar.Engine`) or `base_url=` (a `ragcache serve` sidecar).

    `.last_stats` holds the engine stats of the last call (also in each message's
    `response_metadata["ragcache"]`); `.last_prompt` the ChunkedPrompt it sent, None when the
    call went out as a plain chat (`last_stats["fallback_reason"]` says why). `usage_metadata`
    counts the prompt tokens read from the cache as `input_token_details["cache_read"]`."""

    # an unknown setting (a typo, an OpenAI option this class lacks) is an error, never dropped
    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, extra="forbid")

    model_name: str | None = Field(default=None, alias="model", description="Label only: the engine has one model")
    policy: str = Field(default=DEFAULT_POLICY, description=f"Recompute policy: {forms_text()}")
    order: Order = Field(default="preserve", description="Chunk order the engine uses: " + ", ".join(get_args(Order)))
    tenant: str = ""
    conversation_id: str | None = Field(
        default=None, description="Keep this chat's KV: the next call reuses the turns it repeats exactly")
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    seed: int | None = None
    timeout: float | None = Field(default=600.0, description="Seconds for each sidecar call as a whole (one "
                                  "deadline: retries and streaming included); None: 600")
    max_retries: int = Field(default=3, ge=0, description="Sidecar retries on 429/503 and connect "
                             "timeouts, each only when it can start before the deadline")
    default_headers: dict[str, str] | None = Field(default=None, description="Headers sent with every sidecar "
                                                   "request (a gateway's, a trace id)")
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="More sampling options for every call "
                                         "(e.g. stop_token_ids, ignore_eos); they override the fields")
    streaming: bool = Field(default=False, description="Stream through invoke too (LangChain's switch: callbacks see "
                            "each token)")
    recover_chunks: bool = Field(default=True, description="Look for retrieved documents in the messages")
    min_chunk_chars: int = Field(default=16, ge=1)
    id_key: str = Field(default="id", description="Document metadata key with a stable id (else Document.id)")

    # a typo fails at construction, naming the valid forms, not at the first request
    _policy = field_validator("policy")(classmethod(lambda cls, v: check_policy(v)))
    _extra_sampling = field_validator("model_kwargs")(
        classmethod(lambda cls, v: check_sampling_options(v, "model_kwargs")))

    _backend: Backend = PrivateAttr()
    _last_stats: dict[str, Any] = PrivateAttr(default_factory=dict)
    _last_prompt: ChunkedPrompt | None = PrivateAttr(default=None)

    def __init__(self, *, engine: Any = None, base_url: str | None = None, api_base: str | None = None,
                 api_key: str | None = None, tokenizer: Any = None, **fields: Any):
        super().__init__(**fields)
        url, key = sidecar_address(engine, base_url, api_base, api_key)
        http = {"timeout": self.timeout or 600.0, "retries": self.max_retries, "tokenizer": tokenizer,
                "headers": self.default_headers}
        self._backend = make_backend(engine, url, key, **(http if url is not None else {"headers": self.default_headers}))
        langchain_observer.install()

    @property
    def _llm_type(self) -> str:
        return "ragcache-chunk-cached"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name or self._backend.model_name, "policy": self.policy,
                "order": self.order, "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        # a per-call `model=` only relabels the trace: the engine serves the one model it loaded
        name = kwargs.get("model") or self.model_name or self._backend.model_name
        params = LangSmithParams(ls_provider="ragcache", ls_model_name=name,
                                 ls_model_type="chat", ls_temperature=self.temperature,
                                 ls_max_tokens=self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("ChunkCachedChatModel does not support tool calling: the models ragcache serves "
                                  "have no tool format. Use it for answers over retrieved documents, and a "
                                  "tool-calling model for agents")

    def with_structured_output(self, schema: dict[str, Any] | type, *, include_raw: bool = False,
                               **kwargs: Any) -> NoReturn:
        # LangChain's default would go through bind_tools and blame tool calling, whatever the method
        method = f", method={kwargs['method']!r}" if "method" in kwargs else ""
        raise NotImplementedError(f"ChunkCachedChatModel does not support structured output (with_structured_output"
                                  f"{method}): the engine has neither a JSON mode nor constrained decoding, and the "
                                  "models ragcache serves have no tool format. Describe the format in the prompt "
                                  "and parse the text answer (e.g. with PydanticOutputParser), or use a model "
                                  "that supports structured output")

    def get_num_tokens(self, text: str) -> int:
        # offline, with the model's own tokenizer (LangChain's default would fetch GPT-2's)
        return self._backend.count_tokens(text)

    def remember(self, documents: Sequence[Document]) -> None:
        """Make documents known for chunk recovery without a retriever run (e.g. loaded by hand)."""
        langchain_observer.remember(documents, id_key=self.id_key)

    # --- request ------------------------------------------------------------------------------
    def _sampling(self, stop: list[str] | None, kwargs: dict[str, Any]) -> SamplingParams:
        params: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "stop": stop if stop is not None else (self.stop or []),
                                  "seed": self.seed, **self.model_kwargs}
        params.update({k: v for k, v in kwargs.items() if k in SAMPLING_OPTIONS and v is not None})
        return SamplingParams(**params)

    def plan(self, messages: list[dict[str, str]]) -> Recovery:
        if not self.recover_chunks:
            return Recovery(None, "chunk recovery is off")
        return to_chunked_prompt(messages, REGISTRY.snapshot(), min_chars=self.min_chunk_chars, id_key=self.id_key,
                                 conversation_id=self.conversation_id)

    def _chunked_or_conversation(self, chat: list[dict[str, str]], recovery: Recovery) -> ChunkedPrompt | None:
        if recovery.prompt is not None:
            return recovery.prompt
        if self.conversation_id:  # no passages, but the chat's earlier turns can still be reused
            return ChunkedPrompt(messages=chat, conversation_id=self.conversation_id)
        return None

    def _open(self, messages: Sequence[BaseMessage], stop: list[str] | None,
              kwargs: dict[str, Any]) -> tuple[DeltaStream, Recovery]:
        chat, sampling = to_chat_dicts(messages), self._sampling(stop, kwargs)
        recovery = self.plan(chat)
        prompt = self._chunked_or_conversation(chat, recovery)
        if prompt is not None:
            stream = self._backend.stream(prompt, sampling, policy=self.policy, order=self.order,
                                          tenant=self.tenant)
        else:
            stream = self._backend.stream_chat(chat, sampling, tenant=self.tenant)
        return stream, recovery

    def _aopen(self, messages: Sequence[BaseMessage], stop: list[str] | None,
               kwargs: dict[str, Any]) -> tuple[AsyncDeltaStream, Recovery]:
        chat, sampling = to_chat_dicts(messages), self._sampling(stop, kwargs)
        recovery = self.plan(chat)
        prompt = self._chunked_or_conversation(chat, recovery)
        if prompt is not None:
            stream = self._backend.astream(prompt, sampling, policy=self.policy, order=self.order,
                                           tenant=self.tenant)
        else:
            stream = self._backend.astream_chat(chat, sampling, tenant=self.tenant)
        return stream, recovery

    def _finish(self, result: GenerationResult | None, recovery: Recovery) -> tuple[dict[str, Any], UsageMetadata]:
        chunks = len(recovery.prompt.chunks) if recovery.prompt is not None else 0
        self._last_stats = stats_dict(result, chunks_sent=chunks, fallback_reason=recovery.reason or None)
        self._last_prompt = recovery.prompt
        prompt_tokens, output_tokens, reused = usage_counts(self._last_stats)
        usage = UsageMetadata(input_tokens=prompt_tokens, output_tokens=output_tokens,
                              total_tokens=prompt_tokens + output_tokens,
                              input_token_details=InputTokenDetails(cache_read=reused))
        return self._last_stats, usage

    def _metadata(self, stats: dict[str, Any], result: GenerationResult | None) -> dict[str, Any]:
        return {"ragcache": stats, "model_name": self.model_name or self._backend.model_name,
                "finish_reason": result.finish_reason if result is not None else None}

    # --- LangChain entry points ---------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        stream, recovery = self._open(messages, stop, kwargs)
        text = "".join(stream)
        stats, usage = self._finish(stream.result, recovery)
        message = AIMessage(content=text, usage_metadata=usage, response_metadata=self._metadata(stats, stream.result))
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        stream, recovery = self._aopen(messages, stop, kwargs)
        text = "".join([d async for d in stream])
        stats, usage = self._finish(stream.result, recovery)
        message = AIMessage(content=text, usage_metadata=usage, response_metadata=self._metadata(stats, stream.result))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        stream, recovery = self._open(messages, stop, kwargs)
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager is not None:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        # stats exist once the engine is done: they ride on a last, empty chunk
        stats, usage = self._finish(stream.result, recovery)
        yield ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=usage, chunk_position="last",
                                                         response_metadata=self._metadata(stats, stream.result)))

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        stream, recovery = self._aopen(messages, stop, kwargs)
        async for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager is not None:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        stats, usage = self._finish(stream.result, recovery)
        yield ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=usage, chunk_position="last",
                                                         response_metadata=self._metadata(stats, stream.result)))
