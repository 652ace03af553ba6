"""`ChunkCachedQueryEngine`: a RetrieverQueryEngine whose synthesizer sends nodes as chunks."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.indices.base import BaseIndex
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine

from ragcache_integrations.llama_index.llm import ChunkCachedLLM
from ragcache_integrations.llama_index.synthesizer import ChunkCachedSynthesizer


class ChunkCachedQueryEngine(RetrieverQueryEngine):
    """`ChunkCachedQueryEngine.from_index(index, llm, similarity_top_k=4)` in place of
    `index.as_query_engine(llm=llm, similarity_top_k=4)`."""

    def __init__(self, retriever: BaseRetriever, llm: ChunkCachedLLM, *,
                 node_postprocessors: list[BaseNodePostprocessor] | None = None, streaming: bool = False,
                 text_qa_template: BasePromptTemplate | None = None,
                 callback_manager: CallbackManager | None = None):
        synthesizer = ChunkCachedSynthesizer(llm, text_qa_template=text_qa_template, streaming=streaming,
                                             callback_manager=callback_manager)
        super().__init__(retriever, response_synthesizer=synthesizer, node_postprocessors=node_postprocessors,
                         callback_manager=callback_manager)

    @classmethod
    def from_index(cls, index: BaseIndex, llm: ChunkCachedLLM, *, similarity_top_k: int = 2,
                   **kwargs: Any) -> ChunkCachedQueryEngine:
        return cls(index.as_retriever(similarity_top_k=similarity_top_k), llm, **kwargs)
