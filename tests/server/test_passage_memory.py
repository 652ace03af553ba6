"""The passage memory behind plain OpenAI chats: bounded in bytes for all tenants, filled only
by requests the engine accepted, dropped with a tenant's cache, and fair between tenants."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine_sidecar.server import ServerSettings, create_app
from engine_sidecar.server.passage_book import PassageBook
from ragcache_integrations.types import Chunk

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike".split()


def passage(tenant: str, i: int, words: int = 40) -> str:
    return f"{tenant} passage {i}: " + " ".join(WORDS[(i + n) % len(WORDS)] for n in range(words)) + "."


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    from engine_sidecar import Engine

    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32",
                                    cache_dir=tmp_path_factory.mktemp("book-kv"))
    yield engine
    engine.close()


@pytest.fixture
def app(engine):
    settings = ServerSettings(max_chunk_chars=32_000, max_tokens=64, passage_memory_bytes=64 << 10)
    application = create_app(engine, settings)
    with TestClient(application, raise_server_exceptions=False) as client:
        yield client, application.state.ctx.passages


def test_refused_requests_remember_nothing(app):
    client, book = app
    huge = " ".join(WORDS) * 400  # ~30,000 characters: far past the tiny model's 2,048 tokens
    for tenant in ("t1", "t2", "t3"):
        body = {"prompt": {"question": "Why?", "chunks": [{"text": huge + tenant}]}, "sampling": {"max_tokens": 2}}
        refused = client.post("/v1/generate", json=body, headers={"X-RagCache-Tenant": tenant})
        assert refused.status_code == 413, refused.text
        chat = {"messages": [{"role": "user", "content": "Why?"}], "chunks": [huge + tenant], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat, headers={"X-RagCache-Tenant": tenant}).status_code == 413
    assert len(book) == 0 and book.bytes == 0
    accepted = {"prompt": {"question": "Why?", "chunks": [{"text": passage("t1", 0)}]}, "sampling": {"max_tokens": 2}}
    assert client.post("/v1/generate", json=accepted, headers={"X-RagCache-Tenant": "t1"}).status_code == 200
    assert len(book) == 1


def test_the_memory_stays_within_its_budget_and_delete_frees_it(app):
    client, book = app
    for tenant in ("a", "b", "c", "d"):
        chunks = [passage(tenant, i, words=200) for i in range(40)]
        warmed = client.post("/v1/chunks/warm", json={"chunks": chunks, "neighbours": 0},
                             headers={"X-RagCache-Tenant": tenant})
        assert warmed.status_code == 200, warmed.text
        assert 0 < book.bytes <= 64 << 10
    assert client.delete("/v1/cache", headers={"X-RagCache-Tenant": "d"}).status_code == 200
    assert book.find([{"role": "user", "content": passage("d", 39, words=200)}], "d", None).prompt is None
    assert client.delete("/v1/cache", params={"all_tenants": "true"}).status_code == 200
    assert len(book) == 0 and book.bytes == 0


def test_a_tenant_within_its_fair_share_keeps_its_passages():
    book = PassageBook(capacity=4096, budget_bytes=400_000)
    mine = [Chunk(text=passage("mine", i)) for i in range(3)]  # about 1 KB: under 400 KB / 301 tenants
    book.remember(mine, "victim")
    for n in range(300):  # many other tenants ask for 1 MB in all, 2.5 times the budget
        book.remember([Chunk(text=passage(f"other{n}", i)) for i in range(10)], f"other{n}")
    assert book.bytes <= 400_000 and len(book) < 3 + 300 * 10
    quoted = [{"role": "user", "content": "Context:\n" + "\n\n".join(c.text for c in mine) + "\nQ?"}]
    found = book.find(quoted, "victim", None).prompt
    assert found is not None and len(found.chunks) == len(mine)
