"""OpenAI-compatible chat completions. With the `chunks` extension the request becomes a
chunk-structured prompt (system message -> system, last user message -> question) and gets
chunk KV reuse; without it, it is a plain chat, whose passages this sidecar remembers (warmed or
sent as chunks before) are still reused where the messages quote them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request

from engine_sidecar.errors import RagCacheError
from engine_sidecar.server.context import ServerContext
from engine_sidecar.server.engine_call import EngineCall
from engine_sidecar.server.errors import ApiError, engine_error_status, error_body
from engine_sidecar.server.guards import (
    TenantHeader,
    auth_dependency,
    cap_max_tokens,
    check_chunks,
    check_policy,
    check_stops,
    resolve_tenant,
)
from engine_sidecar.server.openai_compat import refuse_unsupported, unsupported_route
from engine_sidecar.server.openapi import CHAT_EVENT, ENGINE_ERRORS, error_responses, sse_responses
from engine_sidecar.server.sse import sse, sse_response
from engine_sidecar.server.tenancy import scope_chunks
from ragcache_integrations.api_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ModelCard,
    ModelList,
    Usage,
)
from ragcache_integrations.types import Chunk, ChunkedPrompt, GenerationResult, SamplingParams

# longer than any token of the tokenizers we load (Qwen's longest is 128 characters): a chat with
# more characters than the context window times this cannot fit, and the plain path refuses it
MAX_CHARS_PER_TOKEN = 256


def openai_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(dependencies=[Depends(auth_dependency(ctx.settings))], responses=error_responses(*ENGINE_ERRORS))
    settings = ctx.settings

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=sse_responses(CHAT_EVENT),
                 summary="OpenAI-compatible chat completions, plus a `chunks` extension for RAG prompts")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               header_tenant: TenantHeader):
        refuse_unsupported(body)
        tenant = resolve_tenant(body.tenant, header_tenant)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        sampling = cap_max_tokens(body.sampling(), getattr(body, field) is not None, settings, field)
        check_stops(sampling.stop, settings, "stop")
        make = _chunked(ctx, body, sampling, tenant) if body.chunks is not None else _plain(ctx, body, sampling, tenant)
        call = EngineCall(ctx, request, "chat", make, tenant)
        await call.start()
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        model = body.model or settings.model_name
        if not body.stream:
            result = await call.result_of()
            return ChatCompletionResponse(
                id=completion_id, created=created, model=model, usage=Usage.of(result), ragcache=result.stats,
                choices=[ChatChoice(message=AssistantMessage(content=result.text), finish_reason=result.finish_reason)])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chat_events(call, completion_id, created, model, include_usage,
                                         settings.request_timeout_s))

    started = int(time.time())

    @router.get("/v1/models", response_model=ModelList, summary="The model this server serves (OpenAI's model list)")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_name, created=started)])

    # OpenAI routes this sidecar does not serve: a 404 that says so (docs/api.md), not a bare one
    @router.post("/v1/completions", include_in_schema=False)
    async def completions() -> None:
        raise unsupported_route("legacy completions", "/v1/completions")

    @router.post("/v1/embeddings", include_in_schema=False)
    async def embeddings() -> None:
        raise unsupported_route("embeddings", "/v1/embeddings")

    return router


def _chunked(ctx: ServerContext, body: ChatCompletionRequest, sampling: SamplingParams, tenant: str):
    assert body.chunks is not None
    check_policy(body.policy, ctx.backend)
    check_chunks(body.chunks, ctx.settings)
    users = [m for m in body.messages if m.role == "user"]
    if not users:
        raise ApiError(422, "messages: with chunks, a user message (the question) is required", "messages",
                       "question_missing")
    chunks = scope_chunks(body.chunks, tenant)
    quoted = _quoted_in_messages(body, chunks)
    if quoted is not None:
        # the app already put the passages in its messages (as RAG frameworks do): keep its chat as
        # it is, every turn included, and reuse the passages where they stand (the verbatim layout)
        prompt = ChunkedPrompt(messages=_plain_messages(body), chunks=quoted, conversation_id=body.conversation_id)
    else:
        turns = [m for m in body.messages if not m.is_system]
        if len(turns) > 1 or turns[-1] is not users[-1]:
            raise ApiError(422, "messages: with chunks that are not quoted in the messages, send the system message "
                                "and one user message (the question); earlier turns have no place in the "
                                "system + chunks + question layout. Continue a conversation with conversation_id, or "
                                "put the passages' text in the messages: then every turn is kept and the passages "
                                "are still reused", "messages", "history_with_chunks")
        systems = [m.text for m in body.messages if m.is_system]
        prompt = ChunkedPrompt(chunks=chunks, question=users[-1].text, conversation_id=body.conversation_id,
                               **({"system": systems[0]} if systems else {}))

    def make() -> Iterator[str | GenerationResult]:
        return ctx.passages.remembering(ctx.backend.generate(prompt, sampling, body.policy, tenant, body.order),
                                        chunks, tenant)

    return make


def _plain_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    # the chat template knows system/user/assistant; "developer" is OpenAI's newer name for system
    return [{"role": "system" if m.is_system else m.role, "content": m.text} for m in body.messages]


def _quoted_in_messages(body: ChatCompletionRequest, chunks: list[Chunk]) -> list[Chunk] | None:
    """The chunks in the order the messages quote them, if every one is quoted verbatim; else None."""
    text = "\n".join(m.text for m in body.messages)
    where = [text.find(c.text) for c in chunks]
    if not chunks or min(where) < 0 or any(not c.text.strip() for c in chunks):
        return None
    order = sorted(range(len(chunks)), key=lambda i: (where[i], i))
    return [chunks[i] for i in order]


def _plain(ctx: ServerContext, body: ChatCompletionRequest, sampling: SamplingParams, tenant: str):
    """A chat without `chunks`: computed in full, unless it quotes passages this sidecar remembers
    for the tenant (passage_book.py); then those are reused in the verbatim layout."""
    messages = _plain_messages(body)
    check_policy(body.policy, ctx.backend)

    def make() -> Iterator[str | GenerationResult]:
        # on the worker thread: matching the remembered passages is string search, off the event
        # loop; a chat too long for the context window in any tokenization is not searched at all
        fits = sum(len(m["content"]) for m in messages) <= ctx.backend.facts().context_window * MAX_CHARS_PER_TOKEN
        recovered = ctx.passages.find(messages, tenant, body.conversation_id).prompt if fits else None
        if recovered is not None:
            return ctx.backend.generate(recovered, sampling, body.policy, tenant, "preserve")
        return ctx.backend.chat(messages, sampling, tenant)

    return make


async def _chat_events(call: EngineCall, completion_id: str, created: int, model: str, include_usage: bool,
                       timeout_s: float) -> AsyncIterator[str]:
    """OpenAI's chunk stream: a role delta, content deltas, a final chunk with finish_reason (and
    the engine stats in `ragcache`), optionally a usage chunk, then `[DONE]`. A failure after the
    first token is a `data: {"error": ...}` event, which OpenAI clients raise as an APIError."""

    def chunk(delta: ChatDelta, finish: str | None = None, **extra) -> str:
        return sse(_dump(ChatCompletionChunk(id=completion_id, created=created, model=model,
                                             choices=[ChatChunkChoice(delta=delta, finish_reason=finish)], **extra)))

    yield chunk(ChatDelta(role="assistant", content=""))
    try:
        async with aclosing(call.events()) as events:
            async for event in events:
                if isinstance(event, GenerationResult):
                    yield chunk(ChatDelta(), event.finish_reason, ragcache=event.stats)
                    if include_usage:
                        yield sse(_dump(ChatCompletionChunk(id=completion_id, created=created, model=model,
                                                            choices=[], usage=Usage.of(event))))
                else:
                    yield chunk(ChatDelta(content=event))
    except RagCacheError as exc:
        yield sse(error_body(engine_error_status(exc), str(exc)))
        return
    except ApiError as exc:  # --engine vllm: vLLM failed or exited mid-answer
        yield sse(error_body(exc.status, exc.message, None, exc.code))
        return
    except Exception:
        yield sse(error_body(500, "internal error; the server log has the details"))
        raise
    if call.outcome == "timeout":
        yield sse(error_body(504, f"the request did not finish within {timeout_s:g} s (--request-timeout)",
                             None, "timeout"))
        return
    yield sse("[DONE]")


def _dump(chunk: ChatCompletionChunk) -> dict:
    """OpenAI's shape: `finish_reason: null` present, a delta holds only what it carries, and
    `usage`/`ragcache` appear only on the chunks that have them."""
    data = chunk.model_dump(mode="json")
    for choice, model in zip(data["choices"], chunk.choices, strict=True):
        choice["delta"] = model.delta.model_dump(mode="json", exclude_none=True)
    return {k: v for k, v in data.items() if not (k in ("usage", "ragcache") and v is None)}
