"""One chunk cache for every layout, over a real `ragcache serve` with the real SmolLM2.

A passage warmed by any documented path (client `warm` = /v1/chunks/warm, `ragcache warm` into
the disk tier) is a hit for every adapter and route that later sends it: the engine's layout
(ChunkCachedRunnable, /v1/generate), the verbatim layout (ChunkCachedLLM in a LlamaIndex query
engine, ChunkCachedChatModel in a LangChain stuff chain) and plain OpenAI chats that quote it.
And KV one layout computed in place serves the other."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_classic")

from langchain_classic.chains import create_retrieval_chain  # noqa: E402
from langchain_classic.chains.combine_documents import create_stuff_documents_chain  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402

from ragcache_integrations import ChunkedPrompt  # noqa: E402
from ragcache_integrations.client import RagCacheClient  # noqa: E402
from ragcache_integrations.langchain import ChunkCachedChatModel, ChunkCachedRunnable  # noqa: E402
from ragcache_integrations.llama_index import ChunkCachedLLM  # noqa: E402
from ragcache_integrations.types import Chunk  # noqa: E402
from tests.integrations.test_langchain import PROMPT, KeywordRetriever  # noqa: E402
from tests.integrations.test_llama_index import embed_model, offline_settings  # noqa: E402, F401 - fixtures
from tests.server.test_server_process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

TOPICS = ["Nile", "Danube", "Amazon", "Volga", "Mekong", "Rhine", "Yukon", "Zambezi", "Ganges", "Murray",
          "Loire", "Indus"]


def passages(topic: str) -> list[str]:
    """Three passages about one topic: each set is used by one case, so hits are that case's own."""
    return [f"The {topic} river report, part one, says the water is clear and cold in winter.",
            f"Fishermen on the {topic} catch trout and perch near the old stone bridge every spring.",
            f"A ferry crosses the {topic} twice a day, carrying cars, bicycles and the morning post."]


def question(topic: str) -> str:
    return f"What do fishermen catch on the {topic}?"


@pytest.fixture(scope="module")
def sidecar(smol_dir, tmp_path_factory):
    """A sidecar whose disk tier already holds three passage sets `ragcache warm` computed."""
    root = tmp_path_factory.mktemp("one-cache")
    files = []
    for topic in ("Loire", "Indus", "Murray"):
        for i, text in enumerate(passages(topic)):
            files.append(root / f"{topic}-{i}.txt")
            files[-1].write_text(text, encoding="utf-8")
    warm = subprocess.run([sys.executable, "-m", "engine_sidecar.cli", "warm", *map(str, files), "--model",
                           str(smol_dir), "--cache-dir", str(root / "kv"), "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr
    with ServerProcess(smol_dir, root / "kv", root / "serve.log", "--threads", "2") as proc:
        yield proc.base


def ask_llama_index(base: str, texts: list[str], ask: str, embed_model) -> dict:  # noqa: F811
    llm = ChunkCachedLLM(base_url=base, max_tokens=4)
    nodes = [TextNode(text=t, id_=f"n{i}") for i, t in enumerate(texts)]
    index = VectorStoreIndex(nodes, embed_model=embed_model)
    index.as_query_engine(llm=llm, similarity_top_k=len(texts)).query(ask)
    assert llm.last_prompt is not None and llm.last_prompt.messages is not None  # the verbatim layout
    return llm.last_stats


def ask_langchain_chat(base: str, texts: list[str], ask: str, _embed) -> dict:
    model = ChunkCachedChatModel(base_url=base, max_tokens=4)
    retriever = KeywordRetriever(docs=[Document(page_content=t, id=f"d{i}") for i, t in enumerate(texts)], k=3)
    create_retrieval_chain(retriever, create_stuff_documents_chain(model, PROMPT)).invoke({"input": ask})
    assert model.last_prompt is not None and model.last_prompt.messages is not None
    return model.last_stats


def ask_openai_plain(base: str, texts: list[str], ask: str, _embed) -> dict:
    context = "\n\n".join(texts)
    body = {"model": "ragcache", "max_tokens": 4,
            "messages": [{"role": "system", "content": "Answer from the context."},
                         {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {ask}"}]}
    reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["ragcache"]


def ask_runnable(base: str, texts: list[str], ask: str, _embed) -> dict:
    runnable = ChunkCachedRunnable(base_url=base, max_tokens=4)
    runnable.invoke({"question": ask, "context": [Document(page_content=t) for t in reversed(texts)]})
    return runnable.last_stats


def ask_native(base: str, texts: list[str], ask: str, _embed) -> dict:
    with RagCacheClient(base) as client:
        result = client.generate(ChunkedPrompt(chunks=[Chunk(text=t) for t in texts[1:] + texts[:1]], question=ask),
                                 {"max_tokens": 4})
    return result.stats.model_dump()


ASKERS: dict[str, Callable[..., dict]] = {
    "llama_index": ask_llama_index, "langchain_chat": ask_langchain_chat, "openai_plain": ask_openai_plain,
    "runnable": ask_runnable, "native": ask_native}


def hits(stats: dict) -> tuple[int, int]:
    return stats["chunk_hits"], stats["chunk_misses"]


@pytest.mark.parametrize("name", list(ASKERS))
def test_passages_warmed_over_http_hit_every_adapter_and_route(sidecar, embed_model, name):  # noqa: F811
    topic = TOPICS[list(ASKERS).index(name)]
    with RagCacheClient(sidecar) as client:
        report = client.warm(passages(topic))
    assert report.computed == 3
    assert hits(ASKERS[name](sidecar, passages(topic), question(topic), embed_model)) == (3, 0)


@pytest.mark.parametrize(("name", "topic"), [("llama_index", "Loire"), ("runnable", "Indus"),
                                            ("openai_plain", "Murray")])
def test_passages_warmed_by_the_cli_hit_both_layouts_and_plain_chats(sidecar, embed_model, name, topic):  # noqa: F811
    assert hits(ASKERS[name](sidecar, passages(topic), question(topic), embed_model)) == (3, 0)


@pytest.mark.parametrize(("first", "then", "topic"), [("llama_index", "runnable", "Ganges"),
                                                      ("runnable", "langchain_chat", "Rhine"),
                                                      ("native", "openai_plain", "Yukon")])
def test_kv_one_layout_computed_serves_the_other(sidecar, embed_model, first, then, topic):  # noqa: F811
    assert hits(ASKERS[first](sidecar, passages(topic), question(topic), embed_model))[0] == 0
    assert hits(ASKERS[then](sidecar, passages(topic), f"Who crosses the {topic}?", embed_model)) == (3, 0)
