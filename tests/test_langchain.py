"""LangChain retrieval chain with ChunkCachedRunnable over the real SmolLM2 engine."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import CallbackManagerForRetrieverRun  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402

from engine_sidecar import Engine  # noqa: E402
from ragcache_integrations.langchain import ChunkCachedRunnable  # noqa: E402

DOCS = [
    Document(id="nile", page_content="The Nile flows north through Egypt into the Mediterranean Sea."),
    Document(id="fuji", page_content="Mount Fuji, 3,776 metres high, is the highest mountain in Japan."),
    Document(id="reef", page_content="The Great Barrier Reef lies off Queensland, Australia.", metadata={}),
    Document(page_content="Lake Titicaca lies between Peru and Bolivia.", metadata={"id": "titicaca"}),
]


class KeywordRetriever(BaseRetriever):
    """Top-k by shared words: a real LangChain retriever, deterministic for the test."""

    docs: list[Document]
    k: int = 2

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        words = set(query.lower().split())
        return sorted(self.docs, key=lambda d: -len(words & set(d.page_content.lower().split())))[: self.k]


@pytest.fixture(scope="module")
def engine(smol_dir, tmp_path_factory):
    with Engine.from_pretrained(smol_dir, device="cpu", dtype="float32",
                                cache_dir=tmp_path_factory.mktemp("lc-kv")) as eng:
        yield eng


def chain(runnable):
    return {"context": KeywordRetriever(docs=DOCS), "input": RunnablePassthrough()} | runnable


def test_retrieval_chain_reuses_chunks_across_questions(engine):
    answer = ChunkCachedRunnable(engine=engine, max_tokens=12)
    first = chain(answer).invoke("Where does the Nile flow into the sea?")
    assert first.strip()
    first_stats = dict(answer.last_stats)
    chain(answer).invoke("Which sea does the Nile reach in Egypt?")
    assert first_stats["chunk_misses"] >= 1
    assert answer.last_stats["chunk_hits"] >= 1  # the Nile passage comes back and is reused
    assert {"chunk_hits", "chunk_misses", "tokens_reused", "tokens_recomputed", "ttft_s"} <= set(answer.last_stats)


def test_stream_async_and_batch_match_invoke(engine):
    answer = ChunkCachedRunnable(engine=engine, max_tokens=10, policy="full")
    question = "How high is Mount Fuji?"
    text = chain(answer).invoke(question)
    assert "".join(chain(answer).stream(question)) == text
    assert asyncio.run(chain(answer).ainvoke(question)) == text

    async def collect() -> str:
        return "".join([d async for d in chain(answer).astream(question)])

    assert asyncio.run(collect()) == text
    assert chain(answer).batch([question, question]) == [text, text]


def test_document_ids_become_chunk_ids(engine):
    runnable = ChunkCachedRunnable(engine=engine, max_tokens=2)
    prompt = runnable._prompt({"question": "q", "context": DOCS})
    assert [c.id for c in prompt.chunks][:2] == ["nile", "fuji"]
    assert prompt.chunks[3].id == "titicaca"
    assert prompt.chunks[2].id == "reef"


def test_missing_question_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="'input' or 'question'"):
        ChunkCachedRunnable(engine=engine).invoke({"context": DOCS})
    with pytest.raises(ValueError, match="exactly one"):
        ChunkCachedRunnable()
