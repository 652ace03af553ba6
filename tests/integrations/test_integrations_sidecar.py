"""The adapters over a real `ragcache serve` process (base_url=), with the real SmolLM2:
LlamaIndex's VectorStoreIndex over Qdrant local mode + MiniLM, and a LangChain retrieval chain.

The in-process tests (test_llama_index.py, test_langchain.py) cover the adapters' logic; these
prove the same behaviour survives the HTTP hop: reuse across queries, `full` == plain, and the
streaming and async paths returning the sync text."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("llama_index.vector_stores.qdrant")
pytest.importorskip("langchain_classic")

from langchain_classic.chains import create_retrieval_chain  # noqa: E402
from langchain_classic.chains.combine_documents import create_stuff_documents_chain  # noqa: E402
from langchain_core.documents import Document  # noqa: E402

from ragcache_integrations.langchain import ChunkCachedChatModel, ChunkCachedRunnable  # noqa: E402
from ragcache_integrations.llama_index import ChunkCachedLLM, ChunkCachedQueryEngine  # noqa: E402
from tests.integrations.test_langchain import DOCS, PROMPT, KeywordRetriever  # noqa: E402
from tests.integrations.test_llama_index import (  # noqa: E402, F401 - fixtures
    Q_NILE,
    Q_NILE_2,
    embed_model,
    index,
    mem_index,
    offline_settings,
    source_ids,
)
from tests.server.test_server_process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sidecar(smol_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sidecar")
    with ServerProcess(smol_dir, root / "kv", root / "serve.log", "--threads", "2") as proc:
        yield proc.base


def test_llama_index_drop_in_over_the_sidecar(index, mem_index, sidecar):  # noqa: F811
    llm = ChunkCachedLLM(base_url=sidecar, max_tokens=10)
    assert llm.metadata.context_window == httpx.get(sidecar + "/health").json()["context_window"]
    qe = index.as_query_engine(llm=llm, similarity_top_k=2)
    first = qe.query(Q_NILE)
    assert str(first).strip() and [c.id for c in llm.last_prompt.chunks] == source_ids(first)
    second = qe.query(Q_NILE_2)
    assert str(second).strip()
    assert llm.last_stats["chunk_hits"] > 0 and llm.last_stats["tokens_reused"] > 0

    full = ChunkCachedLLM(base_url=sidecar, max_tokens=10, policy="full")
    plain = ChunkCachedLLM(base_url=sidecar, max_tokens=10, recover_chunks=False)
    a = str(index.as_query_engine(llm=full, similarity_top_k=2).query(Q_NILE))
    b = str(index.as_query_engine(llm=plain, similarity_top_k=2).query(Q_NILE))
    c = str(ChunkCachedQueryEngine.from_index(index, full, similarity_top_k=2).query(Q_NILE))
    assert a and a == b == c
    streamed = index.as_query_engine(llm=full, similarity_top_k=2, streaming=True).query(Q_NILE)
    assert "".join(streamed.response_gen) == a
    # Qdrant local mode has no async client; the same nodes in memory give the same retrieval
    assert asyncio.run(mem_index.as_query_engine(llm=full, similarity_top_k=2).aquery(Q_NILE)).response == a
    assert llm.count_tokens("The Nile flows north.") > 0


def test_langchain_runnable_and_chat_model_over_the_sidecar(sidecar):
    retriever = KeywordRetriever(docs=DOCS)
    runnable = ChunkCachedRunnable(base_url=sidecar, prompt=PROMPT, max_tokens=10)
    chain = create_retrieval_chain(retriever, runnable)
    assert chain.invoke({"input": "Where does the Nile flow into the sea?"})["answer"].strip()
    chain.invoke({"input": "Which sea does the Nile reach in Egypt?"})
    assert runnable.last_stats["chunk_hits"] >= 1

    # warmed ahead over HTTP, with the runnable's own ids and system prompt: the next prompt hits
    structured = ChunkCachedRunnable(base_url=sidecar, max_tokens=2, tenant="warm-lc")
    warmed = structured.warm(DOCS[:3])
    assert (warmed.computed, warmed.neighbours) == (3, 2)
    structured.invoke({"question": "Where is the reef?", "context": DOCS[2::-1]})
    assert (structured.last_stats["chunk_hits"], structured.last_stats["chunk_misses"]) == (3, 0)
    # with prompt= (the verbatim layout) warm computes the same passages' cores: the next prompt hits
    fresh = [Document(page_content=d.page_content.replace("Nile", "Rhone")) for d in DOCS[:2]]
    assert runnable.warm(fresh, neighbours=0).computed == 2
    runnable.invoke({"input": "Where does the Rhone flow?", "context": fresh})
    assert (runnable.last_stats["chunk_hits"], runnable.last_stats["chunk_misses"]) == (2, 0)

    model = ChunkCachedChatModel(base_url=sidecar, max_tokens=10, policy="full")
    plain = ChunkCachedChatModel(base_url=sidecar, max_tokens=10, recover_chunks=False)
    question = {"input": "How high is Mount Fuji?"}
    chat = create_retrieval_chain(retriever, create_stuff_documents_chain(model, PROMPT))
    want = create_retrieval_chain(retriever, create_stuff_documents_chain(plain, PROMPT)).invoke(question)["answer"]
    assert chat.invoke(question)["answer"] == want and model.last_prompt is not None
    assert "".join(chat.pick("answer").stream(question)) == want
    assert asyncio.run(chat.ainvoke(question))["answer"] == want

    async def astreamed() -> str:
        return "".join([d async for d in chat.pick("answer").astream(question)])

    assert asyncio.run(astreamed()) == want
