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
    prompt = runnable.build_prompt({"question": "q", "context": DOCS})
    assert [c.id for c in prompt.chunks][:2] == ["nile", "fuji"]
    assert prompt.chunks[3].id == "titicaca"
    assert prompt.chunks[2].id == "reef"


def test_missing_question_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="'input' or 'question'"):
        ChunkCachedRunnable(engine=engine).invoke({"context": DOCS})
    with pytest.raises(ValueError, match="exactly one"):
        ChunkCachedRunnable()


# --- the stuff-documents drop-in and the chat model inside real retrieval chains --------------------
from langchain_classic.chains import create_retrieval_chain  # noqa: E402
from langchain_classic.chains.combine_documents import create_stuff_documents_chain  # noqa: E402
from langchain_core.language_models import BaseChatModel  # noqa: E402
from langchain_core.messages import AIMessage, BaseMessage  # noqa: E402
from langchain_core.outputs import ChatGeneration, ChatResult  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402

from ragcache_integrations.langchain import ChunkCachedChatModel  # noqa: E402
from ragcache_integrations.langchain_chat import to_chat_dicts  # noqa: E402
from ragcache_integrations.recovery import REGISTRY  # noqa: E402

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question using only this context:\n\n{context}"),
    ("human", "{input}"),
])


class PlainEngineChat(BaseChatModel):
    """The baseline: a plain, non-caching chat model over the same engine (`engine.stream_chat`)."""

    engine: object
    max_tokens: int = 12
    seen: list = []

    @property
    def _llm_type(self) -> str:
        return "plain-engine"

    def _generate(self, messages: list[BaseMessage], stop=None, run_manager=None, **kwargs) -> ChatResult:
        chat = to_chat_dicts(messages)
        self.seen.append(chat)
        text = "".join(self.engine.stream_chat(chat, {"max_tokens": self.max_tokens}))
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])


def retrieval_chain(combine):
    return create_retrieval_chain(KeywordRetriever(docs=DOCS), combine)


def test_stuff_chain_drop_in_sends_the_stuff_chains_prompt(engine):
    """policy `full`: ChunkCachedRunnable(prompt=...) answers token for token like
    create_stuff_documents_chain(plain model, prompt), so the prompt is the same."""
    plain = PlainEngineChat(engine=engine, max_tokens=12, seen=[])
    cached = ChunkCachedRunnable(engine=engine, prompt=PROMPT, max_tokens=12, policy="full")
    for question in ("Where does the Nile flow into the sea?", "How high is Mount Fuji?"):
        want = retrieval_chain(create_stuff_documents_chain(plain, PROMPT)).invoke({"input": question})
        got = retrieval_chain(cached).invoke({"input": question})
        assert got["answer"] and got["answer"] == want["answer"]
        assert [d.id for d in got["context"]] == [d.id for d in want["context"]]
        sent = cached.build_prompt({"input": question, "context": got["context"]})
        assert sent.messages == plain.seen[-1]
        assert [c.id for c in sent.chunks] == [d.id or d.metadata["id"] for d in got["context"]]


def test_stuff_chain_drop_in_reuses_documents_and_reports_stats(engine):
    cached = ChunkCachedRunnable(engine=engine, prompt=PROMPT, max_tokens=12)
    events = []

    async def run() -> None:
        async for event in retrieval_chain(cached).astream_events({"input": "Which sea does the Nile reach?"},
                                                                   version="v2"):
            if event["event"] == "on_custom_event" and event["name"] == "ragcache_stats":
                events.append(event["data"])

    retrieval_chain(cached).invoke({"input": "Where does the Nile flow into the sea?"})
    asyncio.run(run())
    assert cached.last_stats["chunk_hits"] >= 1 and cached.last_stats["tokens_reused"] > 0
    assert events and events[-1]["chunk_hits"] == cached.last_stats["chunk_hits"]


def chat_chain(model):
    return retrieval_chain(create_stuff_documents_chain(model, PROMPT))


def test_chat_model_in_a_retrieval_chain_recovers_documents_and_reuses_them(engine):
    REGISTRY.clear()
    model = ChunkCachedChatModel(engine=engine, max_tokens=12)
    first = chat_chain(model).invoke({"input": "Where does the Nile flow into the sea?"})
    assert first["answer"].strip()
    # the retriever's documents were seen through the callback hook and found in the prompt
    assert [c.id for c in model.last_prompt.chunks] == [d.id or d.metadata["id"] for d in first["context"]]
    chat_chain(model).invoke({"input": "Which sea does the Nile reach in Egypt?"})
    stats = model.last_stats
    assert stats["chunk_hits"] >= 1 and stats["tokens_reused"] > 0 and stats["fallback_reason"] is None
    assert {"chunk_hits", "chunk_misses", "tokens_reused", "tokens_recomputed", "ttft_s"} <= set(stats)


def test_chat_model_policy_full_equals_plain_model_and_all_paths_agree(engine):
    plain = PlainEngineChat(engine=engine, max_tokens=10, seen=[])
    model = ChunkCachedChatModel(engine=engine, max_tokens=10, policy="full")
    question = {"input": "How high is Mount Fuji?"}
    want = chat_chain(plain).invoke(question)["answer"]
    got = chat_chain(model).invoke(question)["answer"]
    assert got == want and model.last_prompt is not None and model.last_prompt.messages == plain.seen[-1]
    answer_only = chat_chain(model).pick("answer")
    assert "".join(answer_only.stream(question)) == want
    assert asyncio.run(chat_chain(model).ainvoke(question))["answer"] == want

    async def collect() -> str:
        return "".join([d async for d in answer_only.astream(question)])

    assert asyncio.run(collect()) == want
    assert [r["answer"] for r in chat_chain(model).batch([question, question])] == [want, want]


def test_chat_model_without_known_documents_is_a_plain_chat(engine):
    model = ChunkCachedChatModel(engine=engine, max_tokens=6, policy="cacheblend")
    message = model.invoke("Say something about the weather on Mars today, please.")
    assert model.last_prompt is None
    assert model.last_stats["fallback_reason"] == "none of the retrieved passages occurs in the prompt"
    assert message.response_metadata["ragcache"] == model.last_stats
    assert message.usage_metadata["output_tokens"] == model.last_stats["decode_tokens"]
    with pytest.raises(ValueError, match="tool"):
        from langchain_core.messages import ToolMessage

        model.invoke([ToolMessage(content="42", tool_call_id="x")])


def test_chat_model_with_a_conversation_id_reuses_earlier_turns(engine):
    from langchain_core.messages import HumanMessage, SystemMessage

    model = ChunkCachedChatModel(engine=engine, max_tokens=6, conversation_id="lc-chat", tenant="lc-chat")
    history = [SystemMessage(content="You are brief."), HumanMessage(content="Name a long river in Africa.")]
    reply = model.invoke(history)
    model.invoke([*history, reply, HumanMessage(content="Which sea does it reach?")])
    first = model.last_stats["plan"][0]
    assert first["kind"] == "history" and first["mode"] == "exact" and model.last_stats["tokens_reused"] > 0


def test_chat_model_sends_every_engine_order_and_refuses_a_typo(engine):
    REGISTRY.clear()
    for order in ("hits-first", "misses-first"):
        model = ChunkCachedChatModel(engine=engine, max_tokens=2, policy="full", order=order)
        chat_chain(model).invoke({"input": "Where does the Nile flow into the sea?"})
        assert model.last_prompt is not None and model.last_stats["fallback_reason"] is None
    with pytest.raises(ValueError, match="misses-first"):
        ChunkCachedChatModel(engine=engine, order="misses_first")


def test_warming_documents_known_together_makes_every_later_prompt_hit(engine):
    runnable = ChunkCachedRunnable(engine=engine, max_tokens=2, system="Answer from the passages.", tenant="warmed")
    report = runnable.warm(DOCS)
    assert (report.chunks, report.computed, report.neighbours) == (4, 4, 2)  # each after its two nearest
    assert report.tokens_prefilled > 0
    assert runnable.warm(DOCS).computed == 0  # kept
    runnable.invoke({"question": "Where is Lake Titicaca?", "context": DOCS[::-1]})
    assert (runnable.last_stats["chunk_hits"], runnable.last_stats["chunk_misses"]) == (4, 0)
    alone = ChunkCachedRunnable(engine=engine, tenant="alone").warm(DOCS[:1])
    assert (alone.computed, alone.neighbours) == (1, 0)  # a lone passage is computed alone
