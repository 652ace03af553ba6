"""LangChain: `ChunkCachedRunnable`, a drop-in for a stuff-documents chain.

It takes the dict retrieval chains carry (`{"input" or "question": str, "context": [Document]}`)
and answers with each Document sent as its own chunk (id from `Document.id`, else
`metadata[id_key]`, else a hash of the text), so retrieved passages are reused across questions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.documents import Document
from langchain_core.runnables import Runnable, RunnableConfig

from ragcache_integrations.backend import make_backend, stats_dict
from ragcache_integrations.types import Chunk, ChunkedPrompt, SamplingParams


class ChunkCachedRunnable(Runnable[dict, str]):
    def __init__(self, *, engine: Any = None, base_url: str | None = None, api_key: str | None = None,
                 system: str | None = None, policy: str = "cacheblend", order: str = "preserve", tenant: str = "",
                 conversation_id: str | None = None, max_tokens: int = 256, temperature: float = 0.0,
                 id_key: str = "id"):
        self.backend = make_backend(engine, base_url, api_key)
        self.system, self.policy, self.order, self.tenant = system, policy, order, tenant
        self.conversation_id, self.id_key = conversation_id, id_key
        self.sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        self.last_stats: dict[str, Any] = {}

    def _prompt(self, inputs: dict) -> ChunkedPrompt:
        question = inputs.get("input", inputs.get("question"))
        if not isinstance(question, str):
            raise ValueError("ChunkCachedRunnable needs an 'input' or 'question' string in its input dict")
        docs = inputs.get("context") or []
        chunks = [self._chunk(d) for d in docs]
        extra = {"system": self.system} if self.system else {}
        return ChunkedPrompt(chunks=chunks, question=question, conversation_id=self.conversation_id, **extra)

    def _chunk(self, doc: Document | str) -> Chunk:
        if isinstance(doc, str):
            return Chunk(text=doc)
        chunk_id = getattr(doc, "id", None) or doc.metadata.get(self.id_key)
        return Chunk(text=doc.page_content, id=str(chunk_id) if chunk_id else None)

    def stream(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[str]:
        stream = self.backend.stream(self._prompt(input), self.sampling, policy=self.policy, order=self.order,
                                     tenant=self.tenant)
        yield from stream
        self.last_stats = stats_dict(stream.result)

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        return "".join(self.stream(input, config))

    async def ainvoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        return await asyncio.to_thread(self.invoke, input, config)

    async def astream(self, input: dict, config: RunnableConfig | None = None,
                      **kwargs: Any) -> AsyncIterator[str]:
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def produce() -> None:
            try:
                for delta in self.stream(input, config):
                    loop.call_soon_threadsafe(queue.put_nowait, delta)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        task = loop.run_in_executor(None, produce)
        while (item := await queue.get()) is not None:
            yield item
        await task
