"""HTTP request/response models shared by the sidecar server and its clients.

The chunk, prompt, sampling and result models come from `types.py` unchanged; this module only
wraps them into request/response bodies. No fastapi here, so a client never pulls in the server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ragcache_integrations.policy_registry import DEFAULT_POLICY, policy_help
from ragcache_integrations.types import (
    MAX_CONVERSATION_ID_CHARS,
    ChatRole,
    Chunk,
    ChunkedPrompt,
    GenerationResult,
    GenerationStats,
    SamplingParams,
)

TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
TENANT_HEADER = "X-RagCache-Tenant"
# torch seeds its generator from an unsigned 64-bit value; anything larger fails deep in the engine
MAX_SEED = 2**63 - 1

Order = Literal["preserve", "frequency", "hits-first", "misses-first"]


def _tenant_field() -> Any:
    return Field(default=None, pattern=TENANT_PATTERN,
                 description=f"Salts every cache key; overrides the {TENANT_HEADER} header.")


def _chunks_from_strings(value: Any) -> Any:
    # accept bare strings for chunks, as ChunkedPrompt does, so both endpoints read the same
    if isinstance(value, list):
        return [{"text": v} if isinstance(v, str) else v for v in value]
    return value


def _lone_surrogate(value: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], int] | None:
    """Where the first string holding a lone surrogate is (its path and character), if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, exc.start
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, path) or _lone_surrogate(item, (*path, str(key)))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, (*path, str(i)))
            if found:
                return found
    return None


def _reject_lone_surrogates(value: Any) -> Any:
    # JSON may spell a lone surrogate ("\ud800"); such a string cannot be tokenized, stored or
    # echoed back as UTF-8, so the whole body is refused up front, naming the first such field
    found = _lone_surrogate(value)
    if found:
        path, start = found
        raise PydanticCustomError("string_not_utf8",
                                  "text is not valid UTF-8 (a lone surrogate at character {start}); "
                                  "send real characters", {"start": start, "path": ".".join(path)})
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Body(_Strict):
    """A request body: any string with a lone surrogate is a 422 naming its field."""

    _utf8 = model_validator(mode="before")(classmethod(lambda cls, v: _reject_lone_surrogates(v)))


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the cache and was used as is "
                                           "(the stats' tokens_reused), as OpenAI and vLLM report cache hits")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, result: GenerationResult) -> Usage:
        prompt, completion = result.stats.prefill_tokens_total, len(result.token_ids)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=result.stats.tokens_reused))


# --- native API ---------------------------------------------------------------------------------
class RequestSampling(SamplingParams):
    """SamplingParams as accepted over HTTP: the same fields, with the seed bounded so a bad one
    is a 422 naming `sampling.seed` rather than an error inside the engine."""

    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)


class GenerateRequest(_Body):
    prompt: ChunkedPrompt
    sampling: RequestSampling = Field(default_factory=RequestSampling)
    policy: str = Field(default=DEFAULT_POLICY, max_length=64, description=f"Recompute policy: {policy_help()}")
    order: Order = "preserve"
    tenant: str | None = _tenant_field()
    stream: bool = False

    @field_validator("sampling", mode="before")
    @classmethod
    def _plain_sampling(cls, value: Any) -> Any:
        # a SamplingParams built by the caller is checked again under the HTTP bounds
        return value.model_dump() if isinstance(value, SamplingParams) else value


class GenerateResponse(GenerationResult):
    usage: Usage


class WarmRequest(_Body):
    chunks: list[Chunk]
    system: str | None = Field(default=None, description="System prompt the chunks will be used with")
    tenant: str | None = _tenant_field()
    neighbours: int | None = Field(default=None, ge=0, le=8, description=(
        "Compute each chunk after the template prefix and its N most similar chunks of this request "
        "(TF-IDF over token ids) instead of alone; fusion prefers that KV, and it is closer to full "
        "prefill's (docs/benchmarks.md). Unset: 2 when the request holds two or more distinct "
        "chunks (a document's passages warmed together) and the engine supports it, else 0. "
        "0: each chunk alone. N > 0 is not available with --engine vllm"))

    _strings = field_validator("chunks", mode="before")(classmethod(lambda cls, v: _chunks_from_strings(v)))


class WarmResponse(BaseModel):
    chunks: int = Field(description="Chunks in the request")
    computed: int = Field(description="Chunks whose KV was computed now (the rest were cached)")
    neighbours: int = Field(default=0, description="Passages each chunk was computed after (0: alone)")
    tokens_prefilled: int = Field(default=0, description=(
        "Tokens prefilled to compute them: their own, their neighbours' and a template prefix not "
        "cached yet (warming after N neighbours costs about N + 1 times a chunk's own tokens)"))
    seconds: float = Field(default=0.0, description="Time the warm-up took in the engine")


class CacheStats(BaseModel):
    """The chunk store's counters plus planner state. Process-wide: all tenants together."""

    ram_entries: int = 0
    ram_bytes: int = 0
    ram_capacity_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    corrupt_files: int = Field(default=0, description="Disk files that failed verification: deleted, recomputed")
    disk_capacity_bytes: int = Field(default=0, description="Disk tier budget (0 = unlimited)")
    disk_evictions: int = Field(default=0, description="Disk files removed to stay within the budget")
    disk_write_failures: int = Field(default=0, description="Disk writes that failed (full disk, I/O error); "
                                                            "those entries stayed in RAM only")
    disk_writes_dropped: int = Field(default=0, description="Entries not written: the disk write queue was full")
    hits_redis: int = Field(default=0, description="Chunks read from the shared Redis tier (then kept in RAM)")
    redis_misses: int = Field(default=0, description="Lookups the Redis tier answered with no entry")
    redis_corrupt: int = Field(default=0, description="Redis entries found partial or damaged: deleted, recomputed")
    redis_errors: int = Field(default=0, description="Redis calls that failed (down, timeout): a miss or a dropped "
                                                     "write, never an error")
    redis_breaker_opens: int = Field(default=0, description="Times the circuit breaker stopped calling Redis for "
                                                            "its cool-down")
    redis_skipped: int = Field(default=0, description="Redis calls not made while the breaker was open")
    redis_writes: int = Field(default=0, description="Entries written to the Redis tier")
    redis_writes_dropped: int = Field(default=0, description="Entries not written: the Redis write queue was full")
    host_entries: int = Field(default=0, description="Entries in the host-RAM tier behind device memory (GPU only)")
    host_bytes: int = 0
    host_capacity_bytes: int = Field(default=0, description="The host tier's budget (0: no host tier)")
    hits_host: int = Field(default=0, description="Chunks read back from the host tier (then kept on the device)")
    host_demotions: int = Field(default=0, description="Entries device memory evicted that moved to the host tier")
    conversations: int = 0
    cptree_nodes: int = 0


class ClearResponse(BaseModel):
    removed: int = Field(description="Cache entries removed")
    chunk_id: str | None = None


class HealthResponse(BaseModel):
    status: Literal["ok"]
    model: str = Field(description="Model folder name (also the default `model` of chat responses)")
    model_path: str = Field(description="Model folder on the server: a client on the same machine can load "
                                        "its tokenizer for offline token counting")
    context_window: int = Field(description="Prompt + generated tokens the model can hold")
    device: str
    dtype: str
    queue_depth: int = Field(description="Requests queued or running on the engine worker")
    max_queue: int


# --- OpenAI-compatible API -------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is the newer OpenAI name for a system message
    role: ChatRole
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @property
    def is_system(self) -> bool:
        return self.role in ("system", "developer")


def _unserved(neutral: str) -> Any:
    return Field(default=None, description=f"Not served: {neutral}; anything else is refused (400)")


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Body):
    """OpenAI chat completions, plus extensions: `chunks` (retrieved passages as structure),
    `policy`, `order`, `tenant`, `conversation_id`. With chunks, the first system message is the
    system prompt and the last user message the question; without, a plain chat computed in full."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float | None = Field(default=None, ge=0.0, le=5.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    n: int | None = Field(default=None, ge=1, description="Only 1: more is refused (400)")
    user: str | None = None
    # OpenAI parameters this endpoint does not serve: accepted at the neutral values clients send
    # by default, refused with a 400 naming the feature otherwise (server/openai_compat.py), so
    # an app learns what is missing instead of reading "Extra inputs are not permitted"
    tools: list[dict[str, Any]] | None = _unserved("[] only: tool calling is not supported")
    tool_choice: str | dict[str, Any] | None = _unserved('"none" or "auto" only (no tools)')
    parallel_tool_calls: bool | None = _unserved("accepted, means nothing without tools")
    functions: list[dict[str, Any]] | None = _unserved("[] only: tool calling is not supported")
    function_call: str | dict[str, Any] | None = _unserved('"none" or "auto" only (no tools)')
    response_format: dict[str, Any] | None = _unserved('{"type": "text"} only: no structured output / JSON mode')
    logprobs: bool | None = _unserved("false only: logprobs are not returned")
    top_logprobs: int | None = _unserved("0 only: logprobs are not returned")
    frequency_penalty: float | None = _unserved("0 only: penalties are not supported")
    presence_penalty: float | None = _unserved("0 only: penalties are not supported")
    logit_bias: dict[str, float] | None = _unserved("{} only: logit_bias is not supported")
    chunks: list[Chunk] | None = Field(default=None, description="Extension: retrieved chunks [{id?, text}]")
    policy: str = Field(default=DEFAULT_POLICY, max_length=64,
                        description=f"Extension: recompute policy, {policy_help()}")
    order: Order = "preserve"
    tenant: str | None = _tenant_field()
    conversation_id: str | None = Field(default=None, max_length=MAX_CONVERSATION_ID_CHARS)

    _strings = field_validator("chunks", mode="before")(classmethod(lambda cls, v: _chunks_from_strings(v)))

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or 256,
            temperature=self.temperature if self.temperature is not None else 0.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            stop=self.stop or [],
            seed=self.seed,
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    ragcache: GenerationStats = Field(description="Extension: what reuse saved for this request")


class ModelCard(BaseModel):
    id: str = Field(description="The model's name: what `model` in a chat completion echoes")
    object: Literal["model"] = "model"
    created: int = Field(description="When the server started (Unix seconds)")
    owned_by: str = "ragcache"


class ModelList(BaseModel):
    """OpenAI's `GET /v1/models`: the one model this sidecar serves."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    ragcache: GenerationStats | None = None


# --- errors ----------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    message: str = Field(description="What was wrong and, for limits, the limit")
    type: str = Field(description="invalid_request_error | authentication_error | rate_limit_error | "
                                  "not_found_error | timeout_error | server_error")
    field: str | None = Field(default=None, description="The offending field, dotted (e.g. sampling.max_tokens)")
    param: str | None = Field(default=None, description="Same as field (the name OpenAI clients read)")
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


__all__ = [
    "MAX_SEED", "TENANT_HEADER", "TENANT_PATTERN", "AssistantMessage", "CacheStats", "ChatChoice",
    "ChatChunkChoice", "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse", "ChatDelta",
    "ChatMessage", "ClearResponse", "ErrorBody", "ErrorResponse", "GenerateRequest", "GenerateResponse", "ModelCard",
    "ModelList",
    "GenerationStats", "HealthResponse", "RequestSampling", "StreamOptions", "TextPart", "Usage", "WarmRequest", "WarmResponse",
]
