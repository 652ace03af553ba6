"""HTTP request/response models shared by the sidecar server and the client (no fastapi here)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragcache_integrations.types import (
    Chunk,
    ChunkedPrompt,
    GenerationResult,
    GenerationStats,
    SamplingParams,
)

TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: ChunkedPrompt
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    policy: str = "cacheblend"
    order: Literal["preserve", "frequency"] = "preserve"
    tenant: str | None = Field(default=None, pattern=TENANT_PATTERN)
    stream: bool = False


class GenerateResponse(GenerationResult):
    usage: dict[str, int] = Field(default_factory=dict)


class WarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunks: list[Chunk]
    system: str | None = None
    tenant: str | None = Field(default=None, pattern=TENANT_PATTERN)


class WarmResponse(BaseModel):
    chunks: int
    computed: int


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(BaseModel):
    """OpenAI chat completions, plus `chunks` (retrieved passages as structure) and ragcache's
    `policy`/`order`/`tenant`. With chunks: the system message is the system prompt and the last
    user message is the question; without: a plain chat computed in full."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float | None = Field(default=None, ge=0.0, le=5.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    user: str | None = None
    chunks: list[Chunk] | None = None
    policy: str = "cacheblend"
    order: Literal["preserve", "frequency"] = "preserve"
    tenant: str | None = Field(default=None, pattern=TENANT_PATTERN)
    conversation_id: str | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or 256,
            temperature=self.temperature if self.temperature is not None else 0.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            stop=self.stop or [],
            seed=self.seed,
        )


class CacheStats(BaseModel):
    ram_entries: int
    ram_bytes: int
    ram_capacity_bytes: int
    disk_entries: int
    disk_bytes: int
    hits_ram: int
    hits_disk: int
    misses: int
    corrupt_files: int
    conversations: int
    cptree_nodes: int


class ErrorBody(BaseModel):
    message: str
    type: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


__all__ = ["GenerateRequest", "GenerateResponse", "WarmRequest", "WarmResponse", "ChatCompletionRequest",
           "ChatMessage", "CacheStats", "ErrorResponse", "GenerationStats", "TENANT_PATTERN"]
