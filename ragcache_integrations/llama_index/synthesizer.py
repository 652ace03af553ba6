"""`ChunkCachedSynthesizer`: the structured path. Nodes go to the engine as chunks with their node
ids, instead of being flattened into one string and recovered afterwards.

It formats the app's QA template (LlamaIndex's default, or `text_qa_template=`) with the nodes
joined the way LlamaIndex's compact synthesizer joins them, so the prompt is the one the drop-in
path recovers from the same query: the two paths send identical ChunkedPrompts. Everything LlamaIndex does around a synthesizer
(events, callbacks, empty responses, streaming response types) is the base class's.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from contextvars import ContextVar
from typing import Any

from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers import BaseSynthesizer, get_response_synthesizer
from llama_index.core.schema import NodeWithScore, QueryType

from ragcache_integrations.llama_index.llm import ChunkCachedLLM, as_dicts
from ragcache_integrations.llama_index.observer import node_text
from ragcache_integrations.recovery import Recovery, with_chunks
from ragcache_integrations.types import Chunk

# how LlamaIndex's compact synthesizer joins node texts into one context string
_JOIN = "\n\n"
# the nodes of the synthesize call under way (base synthesize passes only their texts on), and
# the stats dict its response will carry (filled when a stream ends)
_nodes: ContextVar[Sequence[NodeWithScore]] = ContextVar("ragcache_nodes", default=())
_stats: ContextVar[dict[str, Any] | None] = ContextVar("ragcache_stats", default=None)


class ChunkCachedSynthesizer(BaseSynthesizer):
    def __init__(self, llm: ChunkCachedLLM, text_qa_template: BasePromptTemplate | None = None,
                 streaming: bool = False, callback_manager: CallbackManager | None = None):
        if not isinstance(llm, ChunkCachedLLM):
            raise TypeError("ChunkCachedSynthesizer needs a ChunkCachedLLM")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._cached_llm = llm
        self._text_qa_template = text_qa_template or DEFAULT_TEXT_QA_PROMPT_SEL

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = prompts["text_qa_template"]

    # --- the chunk-structured prompt ----------------------------------------------------------
    def structure(self, query_str: str, text_chunks: Sequence[str]) -> Recovery:
        """The ChunkedPrompt for this query: template around the context, nodes as chunks."""
        llm = self._cached_llm
        ids = {node_text(n.node): n.node.node_id for n in _nodes.get()}
        chunks = [Chunk(text=t.strip(), id=ids.get(t)) for t in text_chunks if t.strip()]
        context = _JOIN.join(c.text for c in chunks)
        messages = llm._extend_messages(
            self._text_qa_template.format_messages(llm=llm, context_str=context, query_str=query_str))
        recovery = with_chunks(as_dicts(messages), chunks)
        if recovery.prompt is None:
            return recovery
        needed = sum(llm.count_tokens(m["content"]) for m in recovery.prompt.messages or [])
        if needed + llm.max_tokens > llm.metadata.context_window:
            # the default synthesizer would repack and refine; so does the fallback below
            return Recovery(None, "the nodes do not fit the context window together")
        return recovery

    def _fallback(self) -> BaseSynthesizer:
        return get_response_synthesizer(llm=self._cached_llm, text_qa_template=self._text_qa_template,
                                        streaming=self._streaming, callback_manager=self._callback_manager)

    def get_response(self, query_str: str, text_chunks: Sequence[str],
                     **response_kwargs: Any) -> str | Generator[str, None, None]:
        recovery = self.structure(query_str, text_chunks)
        if recovery.prompt is None:
            return self._fallback().get_response(query_str, text_chunks, **response_kwargs)
        prompt, llm, out = recovery.prompt, self._cached_llm, self._pending()
        stream = llm.stream_chunked(prompt)
        if not self._streaming:
            text = "".join(stream)
            out.update(llm.record_chunked(prompt, stream.result))
            return text

        def gen() -> Generator[str, None, None]:
            yield from stream
            out.update(llm.record_chunked(prompt, stream.result))

        return gen()

    async def aget_response(self, query_str: str, text_chunks: Sequence[str],
                            **response_kwargs: Any) -> str | AsyncGenerator[str, None]:
        recovery = self.structure(query_str, text_chunks)
        if recovery.prompt is None:
            return await self._fallback().aget_response(query_str, text_chunks, **response_kwargs)
        prompt, llm, out = recovery.prompt, self._cached_llm, self._pending()
        stream = llm.astream_chunked(prompt)
        if not self._streaming:
            text = "".join([d async for d in stream])
            out.update(llm.record_chunked(prompt, stream.result))
            return text

        async def gen() -> AsyncGenerator[str, None]:
            async for delta in stream:
                yield delta
            out.update(llm.record_chunked(prompt, stream.result))

        return gen()

    @staticmethod
    def _pending() -> dict[str, Any]:
        out: dict[str, Any] = {}
        _stats.set(out)
        return out

    # --- carry nodes in, stats out ------------------------------------------------------------
    def synthesize(self, query: QueryType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None,
                   **response_kwargs: Any) -> RESPONSE_TYPE:
        token = _nodes.set(nodes)
        try:
            return super().synthesize(query, nodes, additional_source_nodes, **response_kwargs)
        finally:
            _nodes.reset(token)

    async def asynthesize(self, query: QueryType, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None,
                          **response_kwargs: Any) -> RESPONSE_TYPE:
        token = _nodes.set(nodes)
        try:
            return await super().asynthesize(query, nodes, additional_source_nodes, **response_kwargs)
        finally:
            _nodes.reset(token)

    def _prepare_response_output(self, response_str: Any, source_nodes: list[NodeWithScore]) -> RESPONSE_TYPE:
        response = super()._prepare_response_output(response_str, source_nodes)
        stats = _stats.get()
        if stats is not None:
            # the same dict object: a streaming response's stats appear in it when the stream ends
            response.metadata = {**(response.metadata or {}), "ragcache": stats}
            _stats.set(None)
        return response
