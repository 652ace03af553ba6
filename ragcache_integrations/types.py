"""Plain data shared by client and engine: chunks, chunk-structured prompts, sampling options.

These pydantic models are the wire schema too (the sidecar and the client import them), so a
field added here reaches both sides at once.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# the roles a chat message may have on every route ("developer" is OpenAI's newer name for system)
ChatRole = Literal["system", "developer", "user", "assistant"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)
MAX_CONVERSATION_ID_CHARS = 256
# token ids are int32 in every tokenizer this engine loads; the model's own vocabulary bounds
# them further (checked by the engine, which knows it)
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]

_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Unicode NFC, whitespace runs collapsed, ends stripped: what makes two chunk texts 'the same'."""
    return _SPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def require_utf8(text: str) -> str:
    """Reject strings holding lone surrogates (undecodable bytes smuggled in by surrogateescape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid UTF-8 (character {exc.start}); decode it before sending") from None
    return text


def chunk_id_for(text: str) -> str:
    return "c-" + hashlib.blake2b(normalize_text(text).encode("utf-8"), digest_size=12).hexdigest()


class Chunk(BaseModel):
    """One retrieved passage. `id` defaults to a hash of the normalized text, so the same passage
    gets the same id in every app replica without coordination."""

    model_config = ConfigDict(extra="forbid")

    text: str
    id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    _utf8 = field_validator("text")(classmethod(lambda cls, v: require_utf8(v)))

    @model_validator(mode="after")
    def _default_id(self) -> Chunk:
        if not self.id:
            self.id = chunk_id_for(self.text)
        return self


class ChunkedPrompt(BaseModel):
    """A RAG prompt kept as structure, in one of two layouts.

    - Engine layout (default): system + chunks + question; the engine lays them out with the
      model's chat template and its own question template (no separator strings needed).
    - Verbatim layout (`messages` given): the app's own chat messages, rendered with the model's
      chat template exactly as a plain chat would be, and `chunks` are passages that occur in
      them, in order. The engine finds each chunk's characters in the rendered prompt and caches
      the tokens that fall there, so the tokens computed are exactly those of the plain chat.
      `system` and `question` are not used; framework adapters that only see a flattened prompt
      use this layout.
    """

    model_config = ConfigDict(extra="forbid")

    system: str = "You are a helpful assistant. Answer the question using the passages."
    chunks: list[Chunk] = Field(default_factory=list)
    question: str
    conversation_id: str | None = Field(default=None, max_length=MAX_CONVERSATION_ID_CHARS)
    messages: list[dict[str, str]] | None = Field(
        default=None, description="Verbatim layout: chat messages ({role, content}) that contain the chunks' texts")

    @field_validator("messages")
    @classmethod
    def _known_roles(cls, value: list[dict[str, str]] | None) -> list[dict[str, str]] | None:
        for i, message in enumerate(value or []):
            role = message.get("role")
            if role not in CHAT_ROLES:
                raise PydanticCustomError("unknown_role", "messages[{index}].role is {role}; use one of {roles}",
                                          {"index": i, "role": repr(role), "roles": ", ".join(CHAT_ROLES)})
        return value

    @model_validator(mode="before")
    @classmethod
    def _question_from_messages(cls, value: Any) -> Any:
        # in the verbatim layout the question is inside the messages; keep the field filled
        if isinstance(value, dict) and value.get("messages") is not None and "question" not in value:
            return {**value, "question": ""}
        return value

    _utf8 = field_validator("system", "question")(classmethod(lambda cls, v: require_utf8(v)))

    @field_validator("chunks", mode="before")
    @classmethod
    def _accept_strings(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"text": v} if isinstance(v, str) else v for v in value]
        return value


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=64, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    seed: int | None = None
    # generate past the model's end-of-sequence tokens up to max_tokens, as vLLM's ignore_eos:
    # load benchmarks use it so every system decodes the same number of tokens
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        return value or []


class GenerationStats(BaseModel):
    """What one request cost and what reuse saved. Times in seconds."""

    ttft_s: float = 0.0
    prefill_tokens_total: int = 0
    tokens_reused: int = 0
    tokens_recomputed: int = 0
    tokens_computed_fresh: int = 0
    # of tokens_reused, those placed at other positions than they were computed at (fused: the
    # part that can differ from full prefill); the rest were reused exactly
    tokens_fused: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    # token-layers computed for this request over (prompt tokens x layers): all work on its
    # critical path, an inline precompute of missed chunks included
    computed_fraction: float = 1.0
    token_layers_computed: int = 0  # that work in token-layers (precompute included)
    token_layers_precomputed: int = 0  # the part spent precomputing missed chunks before the prefill
    token_layers_background: int = 0  # queued for a background worker after the request (not included)
    decode_tokens: int = 0
    policy: str = ""
    # what the policy decided for this request: its probe's token-layers and picks (prophet, mix),
    # whether the gate spent its budget and its first-token margin, where Cache-Craft stopped, an
    # `:auto` ratio; empty for policies that decide nothing per request
    policy_decisions: dict[str, Any] = Field(default_factory=dict)
    stage_times: dict[str, float] = Field(default_factory=dict)
    plan: list[dict[str, Any]] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    chunks_deduplicated: int = 0  # chunks dropped because the conversation already holds them
    # `--verify-fraction`: whether full prefill's most likely first token equals this request's
    # reused prefill's; None when this request was not checked
    verified_first_token: bool | None = None


class GenerationResult(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length
    stats: GenerationStats
