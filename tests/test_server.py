"""The sidecar as users run it: a real `ragcache serve` process with the real default model."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ragcache_integrations.client import (
    AsyncRagCacheClient,
    AuthenticationError,
    InvalidRequestError,
    RagCacheClient,
)
from ragcache_integrations.types import ChunkedPrompt

KEY = "test-key"
PASSAGES = [
    "The Nile is about 6,650 km long and flows north into the Mediterranean Sea.",
    "Mount Fuji is the highest mountain in Japan, at 3,776 metres.",
    "The Great Barrier Reef lies off the coast of Queensland, Australia.",
    "Lake Titicaca sits on the border of Peru and Bolivia, high in the Andes.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smol_dir, tmp_path_factory):
    port = _free_port()
    cache = tmp_path_factory.mktemp("server-kv")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_sidecar.cli", "serve", "--model", str(smol_dir), "--port", str(port),
         "--cache-dir", str(cache), "--api-key", KEY, "--max-chunks", "6", "--max-chunk-chars", "4000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("server did not start")
    yield base, proc
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture
def client(server):
    with RagCacheClient(server[0], api_key=KEY) as c:
        yield c


def ask(chunks, question="Which is the highest?"):
    return ChunkedPrompt(chunks=list(chunks), question=question)


def test_startup_line_names_address_model_device_and_tiers(server):
    base, proc = server
    line = proc.stdout.readline()
    assert base.split("//")[1] in line and "SmolLM2" in line and "cpu" in line and "RAM" in line and "disk" in line


def test_generate_and_stream_agree_and_report_stats(client):
    first = client.generate(ask(PASSAGES[:2]), {"max_tokens": 10}, policy="full")
    assert first.text.strip() and first.usage["completion_tokens"] == len(first.token_ids)
    streamed = "".join(client.stream(ask(PASSAGES[:2]), {"max_tokens": 10}, policy="full"))
    assert streamed == first.text
    assert client.last_result is not None and client.last_result.stats.prefill_tokens_total > 0
    again = client.generate(ask(PASSAGES[:2]), {"max_tokens": 4})
    # both chunks come from cache: fused, or (once hot enough) reused exactly from the CP-Tree
    assert again.stats.chunk_hits + again.stats.chunk_misses == 2
    assert again.stats.tokens_reused > 0 and again.text


def test_openai_client_sync_async_and_streaming(server):
    openai = pytest.importorskip("openai")
    base = server[0] + "/v1"
    sync = openai.OpenAI(base_url=base, api_key=KEY)
    chunks = [{"text": t} for t in PASSAGES[1:3]]
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the reef?"}]
    done = sync.chat.completions.create(model="ragcache", messages=messages, max_tokens=8, temperature=0,
                                        extra_body={"chunks": chunks, "policy": "full"})
    text = done.choices[0].message.content
    assert text and done.usage.prompt_tokens > 0
    pieces = sync.chat.completions.create(model="ragcache", messages=messages, max_tokens=8, temperature=0,
                                          stream=True, extra_body={"chunks": chunks, "policy": "full"})
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == text
    plain = sync.chat.completions.create(model="ragcache", messages=[{"role": "user", "content": "Say hi."}],
                                         max_tokens=5)
    assert plain.choices[0].message.content is not None

    async def run_async() -> str:
        client = openai.AsyncOpenAI(base_url=base, api_key=KEY)
        out = await client.chat.completions.create(model="ragcache", messages=messages, max_tokens=8,
                                                   temperature=0, extra_body={"chunks": chunks, "policy": "full"})
        await client.close()
        return out.choices[0].message.content

    assert asyncio.run(run_async()) == text


def test_async_client_generate_matches_sync(client, server):
    expected = client.generate(ask(PASSAGES[2:4]), {"max_tokens": 6}, policy="full").text

    async def run() -> tuple[str, str]:
        c = AsyncRagCacheClient(server[0], api_key=KEY)
        whole = (await c.generate(ask(PASSAGES[2:4]), {"max_tokens": 6}, policy="full")).text
        parts = [d async for d in c.stream(ask(PASSAGES[2:4]), {"max_tokens": 6}, policy="full")]
        await c.aclose()
        return whole, "".join(parts)

    assert asyncio.run(run()) == (expected, expected)


def test_warm_stats_delete(client):
    warmed = client.warm(["A unique passage about the river Thames in London."], tenant="warmco")
    assert warmed.computed == 1
    assert client.warm(["A unique passage about the river Thames in London."], tenant="warmco").computed == 0
    assert client.stats().ram_entries >= 1
    assert client.clear() >= 1
    assert client.stats().ram_entries == 0


def test_metrics_parse(client, server):
    from prometheus_client.parser import text_string_to_metric_families

    client.generate(ask(PASSAGES[:1]), {"max_tokens": 2})
    text = httpx.get(server[0] + "/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"ragcache_requests", "ragcache_ttft_seconds", "ragcache_prompt_tokens", "ragcache_chunk_hit_ratio",
            "ragcache_store_bytes", "ragcache_queue_depth"} <= names


def test_concurrent_requests_equal_sequential(client, server):
    things = ["lantern", "kite", "rice", "snow", "jazz", "tulip", "boat", "cheese", "film", "book", "wine", "dragon"]
    facts = [f"Fact {i}: the {w} festival takes place every year in town {i}." for i, w in enumerate(things)]
    # every chunk belongs to one set only (requested twice in all): below any CP-Tree promotion
    sets = [[facts[2 * i], facts[2 * i + 1]] if i < 4 else [facts[4 + i]] for i in range(8)]
    questions = [f"Question {i}: what is described?" for i in range(8)]
    one_by_one = [client.generate(ask(s, q), {"max_tokens": 6}).token_ids for s, q in zip(sets, questions, strict=True)]

    def call(i: int) -> list[int]:
        with RagCacheClient(server[0], api_key=KEY) as c:
            return c.generate(ask(sets[i], questions[i]), {"max_tokens": 6}).token_ids

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(call, range(8)))
    assert together == one_by_one


GOOD = {"prompt": {"chunks": [{"text": "x"}], "question": "Why?"}, "sampling": {"max_tokens": 4}}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(
    "name,kwargs,status",
    [
        ("malformed-json", {"content": b"{not json", "headers": {**AUTH, "content-type": "application/json"}}, 422),
        ("non-utf8", {"content": b'{"prompt": "\xff\xfe"}', "headers": {**AUTH, "content-type": "application/json"}},
         400),
        ("wrong-type", {"json": {**GOOD, "sampling": {"max_tokens": "many"}}, "headers": AUTH}, 422),
        ("unknown-field", {"json": {**GOOD, "bogus": 1}, "headers": AUTH}, 422),
        ("empty-question", {"json": {**GOOD, "prompt": {"question": "  "}}, "headers": AUTH}, 400),
        ("huge-max-tokens", {"json": {**GOOD, "sampling": {"max_tokens": 10**7}}, "headers": AUTH}, 422),
        ("too-many-chunks", {"json": {**GOOD, "prompt": {"question": "q", "chunks": ["a"] * 7}}, "headers": AUTH},
         413),
        ("oversize-chunk", {"json": {**GOOD, "prompt": {"question": "q", "chunks": ["a" * 5000]}}, "headers": AUTH},
         413),
        ("over-context", {"json": {**GOOD, "prompt": {"question": "q", "chunks": ["7 " * 1999] * 6}},
                          "headers": AUTH}, 413),
        ("bad-key", {"json": GOOD, "headers": {"Authorization": "Bearer wrong"}}, 401),
        ("no-key", {"json": GOOD}, 401),
        ("bad-tenant-field", {"json": {**GOOD, "tenant": "no spaces!"}, "headers": AUTH}, 422),
        ("bad-tenant-header", {"json": GOOD, "headers": {**AUTH, "X-RagCache-Tenant": "a/b"}}, 400),
        ("bad-policy", {"json": {**GOOD, "policy": "magic"}, "headers": AUTH}, 400),
    ],
)
def test_bad_inputs_get_documented_4xx_and_server_stays_healthy(server, name, kwargs, status):
    response = httpx.post(server[0] + "/v1/generate", timeout=120, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"


def test_client_raises_typed_errors(server):
    with RagCacheClient(server[0], api_key="nope") as bad:
        with pytest.raises(AuthenticationError):
            bad.stats()
    with RagCacheClient(server[0], api_key=KEY) as good:
        with pytest.raises(InvalidRequestError, match="limit is 6"):
            good.generate(ask(["a"] * 7))
