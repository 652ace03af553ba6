"""LangChain: `ChunkCachedRunnable`, a drop-in for a stuff-documents chain, and
`ChunkCachedChatModel` (in `langchain_chat.py`) for chains that format their own prompt.

The runnable takes the dict retrieval chains carry (`{"input" or "question": str, "context":
[Document]}`) and answers with each Document sent as its own chunk (id from the
`metadata["ragcache_chunk_id"]` tag `ChunkTaggingRetriever` sets, else `Document.id`, else
`metadata[id_key]`, else a hash of the text), so retrieved passages are reused across questions.

- Without `prompt=`: the engine's own layout (system | chunks | question), which also supports
  `conversation_id` (the next turn continues from this turn's KV).
- With `prompt=` (the ChatPromptTemplate you gave `create_stuff_documents_chain`): the documents
  are formatted and joined exactly as that chain does and the template is filled the same way,
  so the model computes the very tokens the stuff chain would send (verbatim layout).

The answer is a str, like the chain it replaces; the engine stats are in `.last_stats` and are
dispatched as the custom callback event `ragcache_stats` (visible in `astream_events`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from ragcache_integrations.extras import require

require("langchain_core", "LangChain", "langchain")

from langchain_core.callbacks.manager import adispatch_custom_event, dispatch_custom_event  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document  # noqa: E402
from langchain_core.runnables import Runnable, RunnableConfig, ensure_config  # noqa: E402
from langchain_core.runnables.config import run_in_executor  # noqa: E402

from ragcache_integrations.api_models import WarmResponse  # noqa: E402
from ragcache_integrations.backend import (  # noqa: E402
    check_sampling_options,
    make_backend,
    sidecar_address,
    stats_dict,
)
from ragcache_integrations.langchain_chat import ChunkCachedChatModel, to_chat_dicts  # noqa: E402
from ragcache_integrations.langchain_observer import document_id  # noqa: E402
from ragcache_integrations.langchain_retriever import ChunkOrderTransformer, ChunkTaggingRetriever  # noqa: E402
from ragcache_integrations.policy_registry import DEFAULT_POLICY, check_policy  # noqa: E402
from ragcache_integrations.recovery import with_chunks  # noqa: E402
from ragcache_integrations.types import Chunk, ChunkedPrompt, SamplingParams  # noqa: E402

__all__ = ["ChunkCachedChatModel", "ChunkCachedRunnable", "ChunkOrderTransformer", "ChunkTaggingRetriever"]

DEFAULT_DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")
DEFAULT_DOCUMENT_SEPARATOR = "\n\n"


class ChunkCachedRunnable(Runnable[dict, str]):
    def __init__(self, *, engine: Any = None, base_url: str | None = None, api_base: str | None = None,
                 api_key: str | None = None, prompt: BasePromptTemplate | None = None,
                 document_prompt: BasePromptTemplate | None = None,
                 document_separator: str = DEFAULT_DOCUMENT_SEPARATOR, document_variable_name: str = "context",
                 system: str | None = None, policy: str = DEFAULT_POLICY, order: str = "preserve", tenant: str = "",
                 conversation_id: str | None = None, max_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, stop: list[str] | str | None = None, seed: int | None = None,
                 timeout: float = 600.0, max_retries: int = 3, id_key: str = "id",
                 default_headers: dict[str, str] | None = None, additional_kwargs: dict[str, Any] | None = None):
        if prompt is not None and conversation_id is not None:
            raise ValueError("conversation_id works with the engine's own layout: leave out prompt= to use it "
                             "(with prompt=, put the history in your template)")
        check_policy(policy)  # a typo fails here, naming the valid forms, not at the first request
        url, key = sidecar_address(engine, base_url, api_base, api_key)
        extra = check_sampling_options(additional_kwargs, "additional_kwargs")
        http = {"timeout": timeout, "retries": max_retries} if url is not None else {}
        self.backend = make_backend(engine, url, key, headers=default_headers, **http)
        self.prompt = prompt
        self.document_prompt = document_prompt or DEFAULT_DOCUMENT_PROMPT
        self.document_separator, self.document_variable_name = document_separator, document_variable_name
        self.system, self.policy, self.order, self.tenant = system, policy, order, tenant
        self.conversation_id, self.id_key = conversation_id, id_key
        self.sampling = SamplingParams(**{"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                                          "stop": stop or [], "seed": seed, **extra})
        self.last_stats: dict[str, Any] = {}

    # --- the prompt -----------------------------------------------------------------------------
    def build_prompt(self, inputs: dict) -> ChunkedPrompt:
        """The ChunkedPrompt sent for these chain inputs."""
        if not isinstance(inputs, dict):
            raise ValueError("ChunkCachedRunnable takes a dict: {'input' or 'question': str, 'context': [Document]}")
        docs = [Document(page_content=d) if isinstance(d, str) else d
                for d in inputs.get(self.document_variable_name) or []]
        if self.prompt is not None:
            return self._verbatim(inputs, docs)
        question = inputs.get("input", inputs.get("question"))
        if not isinstance(question, str):
            raise ValueError("ChunkCachedRunnable needs an 'input' or 'question' string in its input dict")
        chunks = [Chunk(text=d.page_content, id=document_id(d, self.id_key)) for d in docs]
        extra = {"system": self.system} if self.system else {}
        return ChunkedPrompt(chunks=chunks, question=question, conversation_id=self.conversation_id, **extra)

    def _verbatim(self, inputs: dict, docs: list[Document]) -> ChunkedPrompt:
        assert self.prompt is not None
        texts = [format_document(d, self.document_prompt) for d in docs]
        values = {**inputs, self.document_variable_name: self.document_separator.join(texts)}
        missing = set(self.prompt.input_variables) - set(values)
        if missing:
            raise ValueError(f"the prompt needs {sorted(missing)}, which the input dict does not have")
        messages = to_chat_dicts(self.prompt.format_prompt(**values).to_messages())
        chunks = [Chunk(text=t, id=document_id(d, self.id_key)) for t, d in zip(texts, docs, strict=True)]
        recovery = with_chunks(messages, chunks)
        # documents that render to nothing (or are not quoted) are sent as plain text
        return recovery.prompt or ChunkedPrompt(messages=messages)

    # --- ahead of traffic -----------------------------------------------------------------------
    def warm(self, documents: list[Document | str], neighbours: int | None = None) -> WarmResponse:
        """Precompute the KV of documents this runnable will be given as context, as its prompts
        will hold them (same text, ids, system prompt and tenant). Pass the passages known
        together, a document's, in one call: by default each is computed after its two nearest
        passages of the call, which answers closer to full prefill than KV computed alone; 0
        computes each alone. The response says what the warm-up cost. With `prompt=` the
        documents are formatted by `document_prompt` first, as the prompts will quote them: the
        KV is cached under each passage's core, which both layouts share."""
        docs = [Document(page_content=d) if isinstance(d, str) else d for d in documents]
        texts = [format_document(d, self.document_prompt) if self.prompt is not None else d.page_content
                 for d in docs]
        chunks = [Chunk(text=t, id=document_id(d, self.id_key)) for t, d in zip(texts, docs, strict=True)]
        return self.backend.warm(chunks, self.system, tenant=self.tenant, neighbours=neighbours)

    # --- Runnable -------------------------------------------------------------------------------
    def stream(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[str]:
        stream = self.backend.stream(self.build_prompt(input), self.sampling, policy=self.policy, order=self.order,
                                     tenant=self.tenant)
        yield from stream
        self.last_stats = stats_dict(stream.result)
        self._report(config)

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        return "".join(self.stream(input, config))

    async def ainvoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        return "".join([d async for d in self.astream(input, config)])

    async def astream(self, input: dict, config: RunnableConfig | None = None,
                      **kwargs: Any) -> AsyncIterator[str]:
        prompt = await run_in_executor(config, self.build_prompt, input)
        stream = self.backend.astream(prompt, self.sampling, policy=self.policy, order=self.order,
                                      tenant=self.tenant)
        async for delta in stream:
            yield delta
        self.last_stats = stats_dict(stream.result)
        try:
            await adispatch_custom_event("ragcache_stats", self.last_stats, config=ensure_config(config))
        except RuntimeError:  # called outside a LangChain run: no parent run to report to
            pass

    def _report(self, config: RunnableConfig | None) -> None:
        try:
            dispatch_custom_event("ragcache_stats", self.last_stats, config=ensure_config(config))
        except RuntimeError:  # called outside a LangChain run: no parent run to report to
            pass
