"""The sidecar app in process (Starlette's TestClient) over a real engine with the tiny random
model: every endpoint's error paths, auth, tenants and the event-stream formats. Fast; the
end-to-end behaviour with the real model and a real `ragcache serve` is in test_server.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from engine_sidecar.server import ServerSettings, create_app

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"prompt": {"chunks": [{"text": "x"}], "question": "Why?"}, "sampling": {"max_tokens": 2}}
CHAT = {"messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    from engine_sidecar import Engine

    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32",
                                    cache_dir=tmp_path_factory.mktemp("app-kv"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine):
    settings = ServerSettings(api_key=KEY, max_chunks=3, max_chunk_chars=200, max_body_bytes=20_000, max_tokens=64)
    with TestClient(create_app(engine, settings), raise_server_exceptions=False) as c:
        yield c


def _post(client, path, body=None, headers=AUTH, **kw):
    if body is not None:
        kw["json"] = body
    return client.post(path, headers=headers, **kw)


BAD = [
    # (name, method, path, request kwargs, status, field)
    ("malformed-json", "POST", "/v1/generate", {"content": b'{"prompt": ', "headers": {"content-type": "application/json"}},
     422, None),
    ("non-utf8", "POST", "/v1/generate", {"content": b'{"prompt": {"question": "\xff"}}',
                                          "headers": {"content-type": "application/json"}}, 400, None),
    ("lone-surrogate", "POST", "/v1/generate", {"content": b'{"prompt": {"question": "\\ud800"}}',
                                                "headers": {"content-type": "application/json"}}, 422,
     "prompt.question"),
    ("empty-body", "POST", "/v1/generate", {"content": b"", "headers": {"content-type": "application/json"}}, 422,
     "body"),
    ("body-not-object", "POST", "/v1/generate", {"json": [1, 2]}, 422, "body"),
    ("wrong-type", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"max_tokens": "many"}}}, 422,
     "sampling.max_tokens"),
    ("unknown-field", "POST", "/v1/generate", {"json": {**GOOD, "bogus": 1}}, 422, "bogus"),
    ("unknown-nested-field", "POST", "/v1/generate", {"json": {**GOOD, "prompt": {"question": "q", "x": 1}}}, 422,
     "prompt.x"),
    ("missing-question", "POST", "/v1/generate", {"json": {"prompt": {}}}, 422, "prompt.question"),
    ("empty-question", "POST", "/v1/generate", {"json": {"prompt": {"question": "  "}}}, 400, None),
    ("huge-max-tokens", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"max_tokens": 10**9}}}, 422,
     "sampling.max_tokens"),
    ("zero-max-tokens", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"max_tokens": 0}}}, 422,
     "sampling.max_tokens"),
    ("negative-temperature", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"temperature": -1}}}, 422,
     "sampling.temperature"),
    ("top-p-zero", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"top_p": 0}}}, 422, "sampling.top_p"),
    ("huge-seed", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"seed": 10**30}}}, 422, "sampling.seed"),
    ("empty-stop", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"stop": [""]}}}, 422, "sampling.stop"),
    ("too-many-stops", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"stop": ["a"] * 17}}}, 422,
     "sampling.stop"),
    ("long-stop", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"stop": ["a", "x" * 257]}}}, 422,
     "sampling.stop.1"),
    ("max-tokens-over-server-limit", "POST", "/v1/generate", {"json": {**GOOD, "sampling": {"max_tokens": 65}}}, 422,
     "sampling.max_tokens"),
    ("bad-policy", "POST", "/v1/generate", {"json": {**GOOD, "policy": "magic"}}, 422, "policy"),
    ("bad-policy-ratio", "POST", "/v1/generate", {"json": {**GOOD, "policy": "cacheblend:7"}}, 422, "policy"),
    ("bad-order", "POST", "/v1/generate", {"json": {**GOOD, "order": "random"}}, 422, "order"),
    ("too-many-chunks", "POST", "/v1/generate", {"json": {"prompt": {"question": "q", "chunks": ["a"] * 4}}}, 413,
     "prompt.chunks"),
    ("oversize-chunk", "POST", "/v1/generate", {"json": {"prompt": {"question": "q", "chunks": ["a" * 201]}}}, 413,
     "prompt.chunks.0.text"),
    ("long-chunk-id", "POST", "/v1/generate", {"json": {"prompt": {"question": "q", "chunks": [
        {"id": "i" * 300, "text": "a"}]}}}, 422, "prompt.chunks.0.id"),
    ("control-chunk-id", "POST", "/v1/generate", {"json": {"prompt": {"question": "q", "chunks": [
        {"id": "a\x1fb", "text": "a"}]}}}, 422, "prompt.chunks.0.id"),
    ("over-context", "POST", "/v1/generate", {"json": {**GOOD, "prompt": {"question": "q " * 3000}}}, 413, None),
    ("body-too-large", "POST", "/v1/generate", {"json": {**GOOD, "prompt": {"question": "q" * 30_000}}}, 413, "body"),
    ("bad-tenant-field", "POST", "/v1/generate", {"json": {**GOOD, "tenant": "no spaces!"}}, 422, "tenant"),
    ("bad-tenant-header", "POST", "/v1/generate", {"json": GOOD, "headers": {"X-RagCache-Tenant": "a/b"}}, 422,
     "X-RagCache-Tenant"),
    ("tenant-mismatch", "POST", "/v1/generate", {"json": {**GOOD, "tenant": "a"},
                                                 "headers": {"X-RagCache-Tenant": "b"}}, 400, "tenant"),
    ("chat-no-messages", "POST", "/v1/chat/completions", {"json": {"messages": []}}, 422, "messages"),
    ("chat-bad-role", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "tool", "content": "x"}]}},
     422, "messages.0.role"),
    ("chat-image-part", "POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}}, 422, "messages.0.content.0.type"),
    ("chat-n-2", "POST", "/v1/chat/completions", {"json": {**CHAT, "n": 2}}, 400, "n"),
    ("chat-logprobs", "POST", "/v1/chat/completions", {"json": {**CHAT, "logprobs": True}}, 400, "logprobs"),
    ("chat-unknown-option", "POST", "/v1/chat/completions", {"json": {**CHAT, "bogus_option": 1}}, 422,
     "bogus_option"),
    ("chat-huge-max-tokens", "POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": 10**6}}, 422,
     "max_tokens"),
    ("chat-long-stop", "POST", "/v1/chat/completions", {"json": {**CHAT, "stop": "x" * 257}}, 422, "stop.0"),
    ("chat-max-tokens-over-server-limit", "POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": 65}}, 422,
     "max_tokens"),
    ("chat-max-completion-tokens-over-server-limit", "POST", "/v1/chat/completions", {"json": {
        **CHAT, "max_completion_tokens": 65}}, 422, "max_completion_tokens"),
    ("chat-temperature", "POST", "/v1/chat/completions", {"json": {**CHAT, "temperature": 9}}, 422, "temperature"),
    ("chat-chunks-no-user", "POST", "/v1/chat/completions", {"json": {
        "messages": [{"role": "system", "content": "s"}], "chunks": ["a"]}}, 422, "messages"),
    ("chat-too-many-chunks", "POST", "/v1/chat/completions", {"json": {**CHAT, "chunks": ["a"] * 4}}, 413, "chunks"),
    ("chat-bad-policy", "POST", "/v1/chat/completions", {"json": {**CHAT, "chunks": ["a"], "policy": "x"}}, 422,
     "policy"),
    ("chat-over-context", "POST", "/v1/chat/completions", {"json": {
        "messages": [{"role": "user", "content": "q " * 3000}], "max_tokens": 2}}, 413, None),
    ("chat-chunks-lone-surrogate", "POST", "/v1/chat/completions", {
        "content": b'{"messages": [{"role": "user", "content": "\\ud800"}], "chunks": ["a"], "max_tokens": 2}',
        "headers": {"content-type": "application/json"}}, 422, "messages.0.content"),
    ("chat-lone-surrogate-part", "POST", "/v1/chat/completions", {
        "content": b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}], "max_tokens": 2}',
        "headers": {"content-type": "application/json"}}, 422, "messages.0.content.0.text"),
    ("chat-lone-surrogate-model", "POST", "/v1/chat/completions", {
        "content": b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800", "max_tokens": 2}',
        "headers": {"content-type": "application/json"}}, 422, "model"),
    ("lone-surrogate-chunk-id", "POST", "/v1/generate", {
        "content": b'{"prompt": {"question": "q", "chunks": [{"id": "\\udc80", "text": "a"}]}}',
        "headers": {"content-type": "application/json"}}, 422, "prompt.chunks.0.id"),
    ("warm-not-list", "POST", "/v1/chunks/warm", {"json": {"chunks": "abc"}}, 422, "chunks"),
    ("warm-oversize", "POST", "/v1/chunks/warm", {"json": {"chunks": ["a" * 201]}}, 413, "chunks.0.text"),
    ("delete-empty-id", "DELETE", "/v1/cache?chunk_id=", {}, 422, "chunk_id"),
    ("delete-all-tenants-and-one-tenant", "DELETE", "/v1/cache?all_tenants=true",
     {"headers": {"X-RagCache-Tenant": "t"}}, 400, "all_tenants"),
    ("unknown-path", "GET", "/v2/nothing", {}, 404, None),
    ("wrong-method", "GET", "/v1/generate", {}, 405, None),
]


@pytest.mark.parametrize("name,method,path,kwargs,status,field", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_documented_4xx_naming_the_field(client, name, method, path, kwargs, status, field):
    kwargs = {**kwargs, "headers": {**AUTH, **kwargs.get("headers", {})}}
    response = client.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["field"] == field and error["param"] == field


def test_after_all_bad_inputs_the_app_still_answers(client):
    assert client.get("/health").json()["status"] == "ok"
    assert _post(client, "/v1/generate", GOOD).status_code == 200


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/generate", GOOD), ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chunks/warm", {"chunks": ["a"]}), ("GET", "/v1/cache/stats", None),
    ("DELETE", "/v1/cache?chunk_id=x", None),
])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_every_engine_endpoint_needs_the_key(client, method, path, body, headers):
    response = client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_are_public(client):
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_chunked_body_over_the_limit_is_refused_while_read(client):
    def body():  # no Content-Length: the limit is enforced as the bytes arrive
        yield b'{"prompt": {"question": "'
        for _ in range(30):
            yield b"q" * 1000
        yield b'"}}'

    response = client.post("/v1/generate", content=body(), headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["field"] == "body"


def test_tenants_scope_chunk_ids_for_delete(client):
    chunk = {"id": "shared-doc", "text": "A passage both tenants happen to hold."}
    for tenant in ("alpha", "beta"):
        assert _post(client, "/v1/chunks/warm", {"chunks": [chunk]},
                     headers={**AUTH, "X-RagCache-Tenant": tenant}).json()["computed"] == 1
    removed = client.delete("/v1/cache?chunk_id=shared-doc", headers={**AUTH, "X-RagCache-Tenant": "alpha"})
    assert removed.json()["removed"] >= 1
    # alpha's entry is gone, beta's is untouched
    again = {t: _post(client, "/v1/chunks/warm", {"chunks": [chunk], "tenant": t}).json()["computed"]
             for t in ("alpha", "beta")}
    assert again == {"alpha": 1, "beta": 0}


def test_delete_without_chunk_id_is_the_callers_tenant_only_unless_all_tenants(client):
    chunks = [{"id": f"doc-{i}", "text": f"Passage number {i} of the shared corpus."} for i in range(2)]
    for tenant in ("alpha", "beta", None):
        headers = {**AUTH, "X-RagCache-Tenant": tenant} if tenant else AUTH
        assert _post(client, "/v1/chunks/warm", {"chunks": chunks}, headers=headers).json()["computed"] == 2
    removed = client.delete("/v1/cache", headers={**AUTH, "X-RagCache-Tenant": "alpha"}).json()["removed"]
    assert removed >= 2
    left = {t: _post(client, "/v1/chunks/warm", {"chunks": chunks, **({"tenant": t} if t else {})}).json()["computed"]
            for t in ("alpha", "beta", None)}
    assert left == {"alpha": 2, "beta": 0, None: 0}  # only alpha's entries went (and were computed again)
    client.delete("/v1/cache", headers=AUTH)  # no tenant: the default tenant's
    assert _post(client, "/v1/chunks/warm", {"chunks": chunks, "tenant": "beta"}).json()["computed"] == 0
    assert client.delete("/v1/cache?all_tenants=true", headers=AUTH).status_code == 200
    assert _post(client, "/v1/chunks/warm", {"chunks": chunks, "tenant": "beta"}).json()["computed"] == 2


def test_plan_reports_the_callers_chunk_ids_not_the_scoped_ones(client):
    body = {**GOOD, "prompt": {"question": "q", "chunks": [{"id": "mine", "text": "some longer text"}]}, "tenant": "gamma"}
    plan = _post(client, "/v1/generate", body).json()["stats"]["plan"]
    assert [s["chunk_id"] for s in plan if s["kind"] == "chunk"] == ["mine"]


def _events(text: str) -> list[tuple[str | None, str]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        event = next((line[7:] for line in lines if line.startswith("event: ")), None)
        data = next(line[6:] for line in lines if line.startswith("data: "))
        out.append((event, data))
    return out


def test_native_stream_is_deltas_then_done_with_the_same_text(client):
    whole = _post(client, "/v1/generate", {**GOOD, "sampling": {"max_tokens": 5}}).json()
    response = _post(client, "/v1/generate", {**GOOD, "sampling": {"max_tokens": 5}, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.text)
    deltas = [json.loads(d)["text"] for e, d in events if e is None]
    kind, done = events[-1]
    assert kind == "done" and json.loads(done)["text"] == whole["text"] == "".join(deltas)
    assert json.loads(done)["usage"]["completion_tokens"] == 5


def test_chat_stream_follows_openai_framing(client):
    response = _post(client, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True},
                                                      "chunks": ["a passage"]})
    events = [d for _, d in _events(response.text)]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(d) for d in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and "ragcache" in final[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_chat_accepts_text_parts_and_developer_role(client):
    body = {"messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "?"}]}],
            "max_tokens": 2}
    response = _post(client, "/v1/chat/completions", body)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_openapi_lists_error_responses(client):
    schema = client.get("/openapi.json", headers=AUTH).json()
    generate = schema["paths"]["/v1/generate"]["post"]["responses"]
    assert {"200", "401", "413", "422", "429", "504"} <= set(generate)


@pytest.mark.parametrize("messages,index", [
    ([{"content": "no role"}], 0),
    ([{"role": "user", "content": "fine"}, {"role": "assistant"}], 1),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"content": "x", "name": "n"}], 2),
])
def test_a_bad_verbatim_message_is_a_4xx_naming_it(client, messages, index):
    response = _post(client, "/v1/generate", {"prompt": {"messages": messages}, "sampling": {"max_tokens": 2}})
    assert response.status_code in (400, 422), response.text  # 422: refused by the schema (no role)
    message = response.json()["error"]["message"]
    assert f"messages[{index}]" in message and "\n" not in message


def test_a_default_max_tokens_is_lowered_to_the_servers_limit(client):
    response = _post(client, "/v1/chat/completions", {"messages": CHAT["messages"], "temperature": 1.0, "seed": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 64


@pytest.fixture(scope="module")
def impatient(engine):
    with TestClient(create_app(engine, ServerSettings(request_timeout_s=0.5)), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_timeout_bounds_a_long_generation_and_frees_the_engine(impatient, stream):
    """Sampling at a high temperature with the longest stop string allowed (whose text the engine
    holds back, so it emits nothing for a while): the response still ends at the deadline, as a
    504 or an error event, and the engine stops soon after instead of generating on."""
    import time

    body = {"prompt": {"question": "Tell me everything."}, "stream": stream,
            "sampling": {"max_tokens": 1900, "temperature": 1.1, "seed": 3, "stop": ["x" * 256]}}
    start = time.monotonic()
    response = impatient.post("/v1/generate", json=body)
    assert time.monotonic() - start < 3
    if response.status_code == 504:
        assert response.json()["error"]["type"] == "timeout_error"
    else:
        assert stream and response.status_code == 200, response.text
        kind, data = _events(response.text)[-1]
        assert kind == "error" and json.loads(data)["status"] == 504
    freed = time.monotonic() + 2
    while impatient.get("/health").json()["queue_depth"] and time.monotonic() < freed:
        time.sleep(0.02)
    assert impatient.get("/health").json()["queue_depth"] == 0
