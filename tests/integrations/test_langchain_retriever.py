"""LangChain retriever side: `ChunkTaggingRetriever` / `ChunkOrderTransformer` tag documents with
their stable chunk id and order them by a sliding-window Chunk-Access Table; the adapters send
those ids. Real langchain-core retrievers (a keyword retriever and `InMemoryVectorStore`), real
chains, and the tiny random-weight engine for the end-to-end runs."""

from __future__ import annotations

import asyncio
import threading
import zlib

import pytest
from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from ragcache_integrations.langchain import (
    ChunkCachedChatModel,
    ChunkCachedRunnable,
    ChunkOrderTransformer,
    ChunkTaggingRetriever,
)
from ragcache_integrations.langchain_retriever import CHUNK_ID_KEY
from ragcache_integrations.llama_index import FrequencyOrderPostprocessor
from ragcache_integrations.recovery import REGISTRY
from ragcache_integrations.types import Chunk, chunk_id_for

NILE = Document(id="nile", page_content="The Nile flows north through Egypt into the Mediterranean Sea.")
FUJI = Document(id="fuji", page_content="Mount Fuji, 3,776 metres high, is the highest mountain in Japan.")
REEF = Document(page_content="The Great Barrier Reef lies off Queensland, Australia.", metadata={"id": "reef"})
LAKE = Document(page_content="Lake Titicaca lies between Peru and Bolivia, high in the Andes.")
DOCS = [NILE, FUJI, REEF, LAKE]


class ScriptedRetriever(BaseRetriever):
    """Returns, per query, the documents listed for it, in that order: a real retriever whose
    order the test controls (the order a vector store gives varies with the embedding)."""

    results: dict[str, list[Document]]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return list(self.results[query])


class WordHashEmbeddings(Embeddings):
    """Bag of hashed words: a deterministic embedding, so similarity is shared words."""

    def _embed(self, text: str) -> list[float]:
        vec = [0.0] * 64
        for word in text.lower().replace(",", " ").replace(".", " ").split():
            vec[zlib.crc32(word.encode()) % 64] += 1.0
        return vec

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._embed(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._embed(text)


def ids(docs: list[Document]) -> list[str]:
    return [d.metadata[CHUNK_ID_KEY] for d in docs]


def test_each_document_is_tagged_with_the_id_the_engine_would_use():
    tagged = ChunkTaggingRetriever(retriever=ScriptedRetriever(results={"q": DOCS}), order="preserve").invoke("q")
    assert ids(tagged) == ["nile", "fuji", "reef", chunk_id_for(LAKE.page_content)]
    # an untagged, id-less document gets the id Chunk gives its text: the same on every replica
    assert tagged[3].metadata[CHUNK_ID_KEY] == Chunk(text=LAKE.page_content).id
    assert [d.page_content for d in tagged] == [d.page_content for d in DOCS]
    assert CHUNK_ID_KEY not in LAKE.metadata and REEF.metadata == {"id": "reef"}  # copies: inputs untouched


def test_hot_documents_go_first_in_one_order_whatever_order_the_retriever_gives():
    retriever = ChunkTaggingRetriever(retriever=ScriptedRetriever(results={
        "a": [NILE, FUJI], "b": [FUJI, NILE], "c": [REEF, FUJI, NILE], "d": [NILE, REEF]}))
    assert ids(retriever.invoke("a")) == ["fuji", "nile"]  # a tie: by id
    assert ids(retriever.invoke("b")) == ["fuji", "nile"]  # the same set lines up the same way
    assert ids(retriever.invoke("c")) == ["fuji", "nile", "reef"]  # 3, 3, 1 accesses
    assert ids(retriever.invoke("d")) == ["nile", "reef"]  # nile 4, reef 2
    assert (retriever.count("nile"), retriever.count("fuji"), retriever.count("reef")) == (4, 3, 2)


def test_the_window_forgets_old_queries():
    retriever = ChunkTaggingRetriever(window=2, retriever=ScriptedRetriever(results={
        "nile": [NILE], "fuji": [FUJI], "both": [NILE, FUJI]}))
    for query in ("nile", "nile", "nile", "fuji"):
        retriever.invoke(query)
    assert retriever.count("nile") == 1 and retriever.count("fuji") == 1  # the window holds the last two
    retriever.invoke("fuji")
    assert retriever.count("nile") == 0
    assert ids(retriever.invoke("both")) == ["fuji", "nile"]  # window [fuji, both]: fuji 2, nile 1


def test_preserve_tags_only_and_leaves_the_counts_alone():
    retriever = ChunkTaggingRetriever(order="preserve", retriever=ScriptedRetriever(results={"q": [NILE, FUJI]}))
    assert ids(retriever.invoke("q")) == ["nile", "fuji"] and retriever.count("nile") == 0


def test_wraps_a_vector_store_retriever_sync_and_async_without_touching_the_store():
    store = InMemoryVectorStore(WordHashEmbeddings())
    store.add_documents([Document(page_content=d.page_content, metadata=dict(d.metadata)) for d in DOCS],
                        ids=["nile", "fuji", "reef", "lake"])
    retriever = ChunkTaggingRetriever(retriever=store.as_retriever(search_kwargs={"k": 2}))
    question = "Which sea does the Nile in Egypt flow into?"
    first = retriever.invoke(question)
    assert "nile" in ids(first) and all(d.id for d in first)  # the store's own ids are the chunk ids
    second = asyncio.run(retriever.ainvoke(question))
    assert ids(second) == ids(first) and retriever.count("nile") == 2
    assert all(CHUNK_ID_KEY not in entry["metadata"] for entry in store.store.values())


def test_the_inner_retriever_runs_as_a_child_of_the_wrapper():
    runs: list[tuple[str, object]] = []

    class Runs(BaseCallbackHandler):
        def on_retriever_start(self, serialized, query, *, run_id, parent_run_id=None, **kwargs):
            runs.append((kwargs.get("name") or "", parent_run_id))

        def on_retriever_end(self, documents, *, run_id, parent_run_id=None, **kwargs):
            runs.append(("end", [d.metadata.get(CHUNK_ID_KEY) for d in documents]))

    inner = ScriptedRetriever(results={"q": [FUJI, NILE]})
    ChunkTaggingRetriever(retriever=inner).invoke("q", config={"callbacks": [Runs()]})
    starts = [r for r in runs if r[0] != "end"]
    ends = [r[1] for r in runs if r[0] == "end"]
    assert len(starts) == 2 and starts[0][1] is None and starts[1][1] is not None
    assert ends == [[None, None], ["fuji", "nile"]]  # the inner run's raw documents, then the tagged ones


def test_transformer_in_an_lcel_pipeline_and_under_concurrency():
    order = ChunkOrderTransformer(window=100)
    pipeline = ScriptedRetriever(results={"a": [NILE, FUJI], "b": [FUJI, NILE]}) | RunnableLambda(
        order.transform_documents)
    assert ids(pipeline.invoke("a")) == ids(pipeline.invoke("b")) == ["fuji", "nile"]
    assert ids(asyncio.run(order.atransform_documents([REEF]))) == ["reef"]

    results: list[list[str]] = []
    lock = threading.Lock()

    def ask(query: str) -> None:
        got = ids(pipeline.invoke(query))
        with lock:
            results.append(got)

    threads = [threading.Thread(target=ask, args=("ab"[i % 2],)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # counting and sorting happen together: every query saw both ids equally counted
    assert results == [["fuji", "nile"]] * 16 and order.count("nile") == order.count("fuji") == 18


def test_same_table_as_the_llama_index_postprocessor():
    """Both frameworks order with `ragcache_integrations.access_table.ChunkAccessTable`."""
    post = FrequencyOrderPostprocessor(window=3)
    order = ChunkOrderTransformer(window=3)
    assert type(post._table) is type(order.table)


PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question using only this context:\n\n{context}"),
    ("human", "{input}"),
])


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    from engine_sidecar import Engine

    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32",
                                cache_dir=tmp_path_factory.mktemp("lc-retriever-kv")) as eng:
        yield eng


FLIPPING = ScriptedRetriever(results={"Where does the Nile flow?": [NILE, LAKE],
                                      "Which lake lies between Peru and Bolivia?": [LAKE, NILE]})


def test_runnable_sends_the_tagged_ids_in_the_counted_order_and_reuses_them(engine):
    answer = ChunkCachedRunnable(engine=engine, max_tokens=3)
    seen: list[list[Document]] = []
    context = ChunkTaggingRetriever(retriever=FLIPPING) | RunnableLambda(lambda docs: seen.append(docs) or docs)
    chain = {"context": context, "input": RunnablePassthrough()} | answer
    lake = chunk_id_for(LAKE.page_content)
    prompts = []
    for question in FLIPPING.results:
        chain.invoke(question)
        prompts.append(answer.build_prompt({"input": question, "context": seen[-1]}))
    # the engine layout's chunks carry the tags (`id` for the Nile, the text hash for the lake), and
    # the retriever's flipped order reaches the engine as one order
    assert [c.id for c in prompts[0].chunks] == [c.id for c in prompts[1].chunks] == sorted(["nile", lake])
    assert answer.last_stats["chunk_hits"] == 2  # the second question's two passages, computed by the first


def test_retrieval_chain_context_is_in_the_counted_order_and_chunks_keep_their_ids(engine):
    retriever = ChunkTaggingRetriever(retriever=FLIPPING)
    combine = ChunkCachedRunnable(engine=engine, prompt=PROMPT, max_tokens=3)
    orders = []
    for question in FLIPPING.results:
        out = create_retrieval_chain(retriever, combine).invoke({"input": question})
        orders.append(ids(out["context"]))
        sent = combine.build_prompt({"input": question, "context": out["context"]})
        assert [c.id for c in sent.chunks] == ids(out["context"])
    # the retriever flipped its order; the prompts did not (the same passages in the same order)
    lake = chunk_id_for(LAKE.page_content)
    assert orders == [sorted(["nile", lake])] * 2


def test_chat_model_recovers_the_tagged_ids_through_the_callback_hook(engine):
    REGISTRY.clear()
    model = ChunkCachedChatModel(engine=engine, max_tokens=3)
    chain = create_retrieval_chain(ChunkTaggingRetriever(retriever=FLIPPING),
                                   create_stuff_documents_chain(model, PROMPT))
    out = chain.invoke({"input": "Where does the Nile flow?"})
    assert model.last_prompt is not None
    assert [c.id for c in model.last_prompt.chunks] == ids(out["context"])
