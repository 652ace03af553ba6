"""LangChain, retriever side: tag each retrieved Document with its stable chunk id and put the
most often retrieved documents first (the counterpart of LlamaIndex's `FrequencyOrderPostprocessor`).

- `ChunkTaggingRetriever(retriever=...)` wraps any retriever (anything that maps a query string to
  Documents) and returns the same documents, copied with `metadata["ragcache_chunk_id"]` set and
  ordered by a sliding-window Chunk-Access Table.
- `ChunkOrderTransformer` does the same to a list of Documents, as a `BaseDocumentTransformer`,
  for pipelines that already hold the documents.

Why order on the client: the same hot chunks then open every prompt in the same order, so the
engine's exact chunk-prefix reuse (CP-Tree) hits more often, and the order the app shows (a
chain's `context`, its citations) is the order the model read. The engine can order by its own
table instead (`order="frequency"` on the LLM adapters); use one or the other.

The chunk id is the one every adapter sends: `Document.id`, else `metadata[id_key]`, else a
hash of the normalized text (`chunk_id_for`), so `ChunkCachedRunnable` and `ChunkCachedChatModel`
cache each document under the id it was counted under.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import BaseDocumentTransformer, Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable
from pydantic import ConfigDict, Field, PrivateAttr

from ragcache_integrations.access_table import ChunkAccessTable
from ragcache_integrations.langchain_observer import CHUNK_ID_KEY, stable_chunk_id

Order = Literal["frequency", "preserve"]

__all__ = ["CHUNK_ID_KEY", "ChunkOrderTransformer", "ChunkTaggingRetriever", "tag_documents"]


def tag_documents(documents: Sequence[Document], id_key: str = "id") -> list[Document]:
    """Copies of `documents` with `metadata["ragcache_chunk_id"]` set. Copies, because retrievers
    may hand out Documents (and metadata dicts) that their store still holds."""
    return [doc.model_copy(update={"metadata": {**doc.metadata, CHUNK_ID_KEY: stable_chunk_id(doc, id_key)}})
            for doc in documents]


class ChunkOrderTransformer(BaseDocumentTransformer):
    """Tags documents with their chunk id and, with `order="frequency"`, sorts each call's
    documents by how often they were seen over the last `window` calls (ties by id)."""

    def __init__(self, window: int = 1000, *, order: Order = "frequency", id_key: str = "id"):
        if order not in ("frequency", "preserve"):
            raise ValueError(f"unknown order '{order}': use frequency or preserve")
        self.table = ChunkAccessTable(window)
        self.order, self.id_key = order, id_key

    def count(self, chunk_id: str) -> int:
        return self.table.count(chunk_id)

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> list[Document]:
        tagged = tag_documents(documents, self.id_key)
        if self.order == "preserve":
            return tagged
        return self.table.record_and_sort(tagged, lambda d: d.metadata[CHUNK_ID_KEY])

    async def atransform_documents(self, documents: Sequence[Document], **kwargs: Any) -> list[Document]:
        # in-memory work only: no executor hop needed
        return self.transform_documents(documents, **kwargs)


class ChunkTaggingRetriever(BaseRetriever):
    """Wraps `retriever`; returns its documents tagged with chunk ids, hot ones first.

    >>> retriever = ChunkTaggingRetriever(retriever=vectorstore.as_retriever(k=4))
    >>> rag = create_retrieval_chain(retriever, ChunkCachedRunnable(base_url=..., prompt=prompt))
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: Runnable[str, list[Document]] = Field(description="Any retriever: a query string in, Documents out")
    window: int = Field(default=1000, ge=1, description="How many recent queries the access counts cover")
    order: Order = Field(default="frequency", description="frequency: hot documents first; preserve: tag only")
    id_key: str = Field(default="id", description="Document metadata key with a stable id (else Document.id)")

    _transformer: ChunkOrderTransformer = PrivateAttr()

    def model_post_init(self, context: Any, /) -> None:
        self._transformer = ChunkOrderTransformer(self.window, order=self.order, id_key=self.id_key)

    def count(self, chunk_id: str) -> int:
        """Times `chunk_id` was retrieved over the last `window` queries."""
        return self._transformer.count(chunk_id)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        # the inner retriever runs as a child of this run, so traces show both
        documents = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()})
        return self._transformer.transform_documents(documents)

    async def _aget_relevant_documents(self, query: str, *,
                                       run_manager: AsyncCallbackManagerForRetrieverRun) -> list[Document]:
        documents = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()})
        return await self._transformer.atransform_documents(documents)
