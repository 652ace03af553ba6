"""How LangChain adapters learn which documents the app retrieved: a process-wide callback.

`install()` registers a LangChain configure hook whose context variable always holds one
`RetrievalObserver`, so LangChain attaches it to every run in the process, the way it attaches
its own tracers. On `on_retriever_end` the retrieved documents go into the shared
`ChunkRegistry` (under their text and their id), where `ChunkCachedChatModel` looks for them in
the prompts it is given. Nothing else is observed or kept.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document

from ragcache_integrations.recovery import REGISTRY, ChunkRegistry
from ragcache_integrations.types import chunk_id_for

# where `ChunkTaggingRetriever` writes each document's chunk id; read first by every adapter, so
# the id the documents were ordered by is the id the engine caches them under
CHUNK_ID_KEY = "ragcache_chunk_id"


def document_id(doc: Document, id_key: str = "id") -> str | None:
    """A document's stable id: its `metadata["ragcache_chunk_id"]` tag, else `Document.id`, else
    `metadata[id_key]`, else None (the content hash is applied later)."""
    value = doc.metadata.get(CHUNK_ID_KEY) or getattr(doc, "id", None) or doc.metadata.get(id_key)
    return str(value) if value else None


def stable_chunk_id(doc: Document, id_key: str = "id") -> str:
    """`document_id`, else the content hash `Chunk` would give the text: never None."""
    return document_id(doc, id_key) or chunk_id_for(doc.page_content)


def remember(documents: Sequence[Document], registry: ChunkRegistry = REGISTRY, id_key: str = "id") -> None:
    for doc in documents:
        registry.add(doc.page_content, document_id(doc, id_key), doc.metadata)


class RetrievalObserver(BaseCallbackHandler):
    """Records every retriever's documents; never raises into the app's run."""

    raise_error = False

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        remember(documents)


_OBSERVER = RetrievalObserver()
_observer_var: ContextVar[RetrievalObserver | None] = ContextVar("ragcache_retrieval_observer", default=_OBSERVER)
_installed = False
_lock = threading.Lock()


def install() -> None:
    """Idempotent: the hook is registered once per process."""
    global _installed
    with _lock:
        if _installed:
            return
        from langchain_core.tracers.context import register_configure_hook

        register_configure_hook(_observer_var, inheritable=True)
        _installed = True
