"""The OpenAI-compatible endpoint as an existing OpenAI app meets it: the model list clients read
first, passages the app already put in its messages reused without being sent twice, and earlier
chat turns with chunks kept or refused, never dropped."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine_sidecar import Engine
from engine_sidecar.server import ServerSettings, create_app

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
PASSAGES = ["Mount Fuji is 3,776 m high and last erupted in 1707.", "The Nile flows north into the Mediterranean."]
CONTEXT = "Context:\n" + "\n\n".join(PASSAGES)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32",
                                    cache_dir=tmp_path_factory.mktemp("openai") / "kv")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine, tiny_llama_dir):
    settings = ServerSettings(api_key=KEY, max_tokens=8, model_name=tiny_llama_dir.name)
    with TestClient(create_app(engine, settings), raise_server_exceptions=False) as c:
        yield c


def _chat(client, messages, **extra):
    return client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **extra}, headers=AUTH)


def test_the_model_list_names_the_served_model(client, tiny_llama_dir):
    from openai import OpenAI

    response = client.get("/v1/models", headers=AUTH)
    assert response.status_code == 200, response.text
    assert [m["id"] for m in response.json()["data"]] == [tiny_llama_dir.name]
    official = OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0)
    assert [m.id for m in official.models.list()] == [tiny_llama_dir.name]
    assert client.get("/v1/models").status_code == 401


def test_passages_quoted_in_the_messages_are_reused_not_sent_twice(client):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": f"{CONTEXT}\n\nQuestion: how high is Mount Fuji?"}]
    plain = _chat(client, messages).json()
    first = _chat(client, messages, chunks=PASSAGES)
    assert first.status_code == 200, first.text
    second = _chat(client, messages, chunks=PASSAGES[::-1]).json()  # any order: placed where the text quotes them
    assert first.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert second["ragcache"]["chunk_hits"] == len(PASSAGES) and second["ragcache"]["tokens_reused"] > 0
    full = _chat(client, messages, chunks=PASSAGES, policy="full").json()
    assert full["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_earlier_turns_are_kept_when_the_passages_are_quoted(client):
    messages = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."},
                {"role": "user", "content": f"{CONTEXT}\n\nWhat is my name, and how high is Mount Fuji?"}]
    plain = _chat(client, messages).json()
    with_chunks = _chat(client, messages, chunks=PASSAGES, policy="full")
    assert with_chunks.status_code == 200, with_chunks.text
    assert with_chunks.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert with_chunks.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_earlier_turns_with_unquoted_chunks_are_refused_not_dropped(client):
    messages = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."},
                {"role": "user", "content": "What is my name?"}]
    response = _chat(client, messages, chunks=PASSAGES)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "history_with_chunks" and "conversation_id" in error["message"]
    single = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How high?"}],
                   chunks=PASSAGES)
    assert single.status_code == 200, single.text


BOOK = ["The Danube passes through ten countries on its way to the Black Sea.",
        "Lake Baikal in Siberia holds about a fifth of the world's fresh surface water."]


def test_a_plain_chat_reuses_passages_the_sidecar_remembers(client):
    """An OpenAI app that quotes its passages and never sends `chunks`: passages warmed (or sent
    as chunks) before are found in its messages and their warmed KV reused (one chunk cache for
    both layouts); for their tenant only, with the plain chat's tokens exactly."""
    messages = [{"role": "user", "content": "Context:\n" + "\n\n".join(BOOK) + "\n\nWhich lake holds more water?"}]
    before = _chat(client, messages, policy="full").json()
    assert before["ragcache"]["chunk_hits"] == 0 and before["ragcache"]["chunk_misses"] == 0  # nothing known yet
    warmed = client.post("/v1/chunks/warm", json={"chunks": BOOK}, headers=AUTH)
    assert warmed.status_code == 200, warmed.text
    recognised = _chat(client, messages).json()
    assert recognised["ragcache"]["chunk_hits"] == len(BOOK) and recognised["ragcache"]["chunk_misses"] == 0
    assert recognised["usage"]["prompt_tokens"] == before["usage"]["prompt_tokens"]
    reused = _chat(client, messages).json()
    assert reused["ragcache"]["chunk_hits"] == len(BOOK) and reused["ragcache"]["tokens_reused"] > 0
    exact = _chat(client, messages, policy="full").json()
    assert exact["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
    other = {"X-RagCache-Tenant": "other", **AUTH}
    elsewhere = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, headers=other).json()
    assert elsewhere["ragcache"]["chunk_hits"] == 0 and elsewhere["ragcache"]["chunk_misses"] == 0
    unquoted = _chat(client, [{"role": "user", "content": "Which lake holds more water?"}]).json()
    assert unquoted["ragcache"]["chunk_hits"] == 0 and unquoted["ragcache"]["chunk_misses"] == 0


def test_a_bad_policy_on_a_plain_chat_is_refused(client):
    response = _chat(client, [{"role": "user", "content": "Hello"}], policy="cacheblend:7")
    assert response.status_code == 422, response.text
