"""The sidecar as users run it: one real `ragcache serve` process (session-scoped) with the real
default model, driven by our clients, the official `openai` client and raw HTTP. Greedy decoding
throughout, so equal inputs must give equal token ids."""

from __future__ import annotations

import asyncio
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
from tests.server.test_server_process import ServerProcess

pytestmark = pytest.mark.slow

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PASSAGES = [
    "The Nile is about 6,650 km long and flows north into the Mediterranean Sea.",
    "Mount Fuji is the highest mountain in Japan, at 3,776 metres.",
    "The Great Barrier Reef lies off the coast of Queensland, Australia.",
    "Lake Titicaca sits on the border of Peru and Bolivia, high in the Andes.",
]


@pytest.fixture(scope="session")
def server(smol_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    proc = ServerProcess(smol_dir, root / "kv", root / "serve.log", "--api-key", KEY, "--max-chunks", "6",
                         "--max-chunk-chars", "4000", "--threads", "2")
    with proc:
        yield proc


@pytest.fixture
def client(server):
    with RagCacheClient(server.base, api_key=KEY) as c:
        yield c


def ask(chunks, question="Which is the highest?") -> ChunkedPrompt:
    return ChunkedPrompt(chunks=list(chunks), question=question)


def test_banner_names_address_model_device_dtype_and_tiers(server, smol_dir):
    for part in (server.base, f"model {smol_dir}", "device cpu", "dtype float32", "RAM 2.0 GiB", "disk ",
                 "auth on"):
        assert part in server.banner, server.banner


def test_generate_and_stream_agree_and_report_stats(client):
    first = client.generate(ask(PASSAGES[:2]), {"max_tokens": 10}, policy="full")
    assert first.text.strip() and first.usage.completion_tokens == len(first.token_ids)
    assert first.usage.prompt_tokens == first.stats.prefill_tokens_total > 0
    streamed = list(client.stream(ask(PASSAGES[:2]), {"max_tokens": 10}, policy="full"))
    assert len(streamed) > 1 and "".join(streamed) == first.text
    assert client.last_result is not None and client.last_result.token_ids == first.token_ids
    missed = client.generate(ask(PASSAGES[:2]), {"max_tokens": 4})
    # `full` stores nothing: both chunks miss and are computed in place, then kept
    assert missed.stats.chunk_misses == 2 and missed.stats.tokens_reused == 0
    again = client.generate(ask(PASSAGES[:2]), {"max_tokens": 4})
    assert again.stats.chunk_hits == 2 and again.stats.tokens_reused > 0 and again.text


def test_openai_client_sync_async_and_streaming(server):
    openai = pytest.importorskip("openai")
    base = server.base + "/v1"
    chunks = [{"text": t} for t in PASSAGES[1:3]]
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the reef?"}]
    extra = {"chunks": chunks, "policy": "full"}
    sync = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    done = sync.chat.completions.create(model="ragcache", messages=messages, max_tokens=8, temperature=0,
                                        extra_body=extra)
    text = done.choices[0].message.content
    assert text and done.usage.prompt_tokens > 0 and done.usage.completion_tokens <= 8
    assert done.model == "ragcache" and done.choices[0].finish_reason in ("stop", "length")
    assert done.model_extra["ragcache"]["prefill_tokens_total"] == done.usage.prompt_tokens
    pieces = list(sync.chat.completions.create(model="ragcache", messages=messages, max_tokens=8, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body=extra))
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == text
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == done.usage.completion_tokens
    plain = sync.chat.completions.create(model="ragcache", messages=[{"role": "user", "content": "Say hi."}],
                                         max_tokens=5)
    assert plain.choices[0].message.content is not None and plain.usage.completion_tokens <= 5

    async def run_async() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)
        out = await client.chat.completions.create(model="ragcache", messages=messages, max_tokens=8,
                                                   temperature=0, extra_body=extra)
        stream = await client.chat.completions.create(model="ragcache", messages=messages, max_tokens=8,
                                                      temperature=0, stream=True, extra_body=extra)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return out.choices[0].message.content, streamed

    assert asyncio.run(run_async()) == (text, text)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).chat.completions.create(
            model="ragcache", messages=messages, max_tokens=2)
    with pytest.raises(openai.UnprocessableEntityError, match="max_tokens"):
        sync.chat.completions.create(model="ragcache", messages=messages, max_tokens=10**6)


def test_async_client_matches_the_sync_one(client, server):
    expected = client.generate(ask(PASSAGES[2:4]), {"max_tokens": 6}, policy="full")
    chat = client.chat([{"role": "user", "content": "Where is the lake?"}], chunks=PASSAGES[3:4], max_tokens=4,
                       policy="full")

    async def run():
        async with AsyncRagCacheClient(server.base, api_key=KEY) as c:
            whole = await c.generate(ask(PASSAGES[2:4]), {"max_tokens": 6}, policy="full")
            parts = [d async for d in c.stream(ask(PASSAGES[2:4]), {"max_tokens": 6}, policy="full")]
            last = c.last_result
            achat = await c.chat([{"role": "user", "content": "Where is the lake?"}], chunks=PASSAGES[3:4],
                                 max_tokens=4, policy="full")
            achat_parts = [d async for d in c.stream_chat([{"role": "user", "content": "Where is the lake?"}],
                                                          chunks=PASSAGES[3:4], max_tokens=4, policy="full")]
            assert "".join(achat_parts) == achat.choices[0].message.content == c.last_result.text
            return whole, "".join(parts), last, achat, await c.health(), await c.stats()

    whole, streamed, last, achat, health, stats = asyncio.run(run())
    assert whole.token_ids == expected.token_ids and streamed == expected.text
    assert last is not None and last.token_ids == expected.token_ids
    assert achat.choices[0].message.content == chat.choices[0].message.content
    assert health.status == "ok" and health.model == "SmolLM2-135M-Instruct"
    assert health.context_window == 8192 and health.model_path.endswith("SmolLM2-135M-Instruct")
    sync_parts = list(client.stream_chat([{"role": "user", "content": "Where is the lake?"}], chunks=PASSAGES[3:4],
                                         max_tokens=4, policy="full"))
    assert "".join(sync_parts) == chat.choices[0].message.content
    assert client.last_result is not None and client.last_result.stats.prefill_tokens_total > 0
    assert stats.ram_entries >= 1


def test_warm_stats_and_delete(client):
    passage = "A unique passage about the river Thames in London."
    first = client.warm([passage], tenant="warmco")
    assert (first.computed, first.neighbours) == (1, 0)  # a lone passage has nothing to be computed after
    assert first.tokens_prefilled > 0 and first.seconds > 0
    again = client.warm([passage], tenant="warmco")
    assert (again.computed, again.tokens_prefilled) == (0, 0)  # cached now
    assert client.warm([passage], tenant="otherco").computed == 1  # tenants never share KV
    before = client.stats()
    assert before.ram_entries >= 2 and before.disk_entries >= 0
    from ragcache_integrations.types import chunk_id_for

    assert client.clear(chunk_id_for(passage), tenant="warmco") == 1  # only warmco's entry
    assert client.warm([passage], tenant="otherco").computed == 0
    client.clear()  # no tenant: the default tenant's entries only
    assert client.warm([passage], tenant="otherco").computed == 0
    assert client.clear(all_tenants=True) >= 1
    after = client.stats()
    assert after.ram_entries == 0 and after.disk_entries == 0


def test_warm_after_neighbours_over_http(client, server):
    passages = ["The Rhine flows from the Swiss Alps to the North Sea through Germany.",
                "The Rhone flows from the Swiss Alps to the Mediterranean through France.",
                "Basalt is a dark volcanic rock formed from rapidly cooled lava."]
    assert client.warm(passages, tenant="nbco", neighbours=2).computed == 3
    assert client.warm(passages, tenant="nbco", neighbours=2).computed == 0  # kept
    stats = client.generate(ChunkedPrompt(chunks=passages[::-1], question="Where does the Rhine end?"),
                            {"max_tokens": 2}, tenant="nbco").stats
    assert (stats.chunk_hits, stats.chunk_misses) == (3, 0)
    # passages known together, no count given: each after its two nearest, with the cost said
    together = ["The Volga flows from the Valdai Hills to the Caspian Sea through Russia.",
                "The Ural flows from the Ural Mountains to the Caspian Sea through Kazakhstan.",
                "Granite is a coarse igneous rock formed from slowly cooled magma."]
    auto = client.warm(together, tenant="nbco")
    assert (auto.computed, auto.neighbours) == (3, 2)
    alone = client.warm(together, tenant="nbco", neighbours=0)
    assert alone.computed == 3  # the entries computed alone are others: the default did not make them
    assert auto.tokens_prefilled > 2 * alone.tokens_prefilled  # each chunk prefilled with its two neighbours
    assert client.warm(together, tenant="nbco", neighbours=2).computed == 0  # what the default made
    for bad in (-1, 9, "two"):
        response = httpx.post(server.base + "/v1/chunks/warm", json={"chunks": passages, "neighbours": bad}, headers=AUTH,
                                  timeout=30)
        assert response.status_code == 422 and response.json()["error"]["field"].endswith("neighbours")


def test_tenants_do_not_share_chunk_caches(client):
    passage = "The Atacama Desert in Chile is among the driest places on Earth."
    client.warm([passage], tenant="acme")
    prompt = ask([passage], "Where is the Atacama?")
    other = client.generate(prompt, {"max_tokens": 2}, tenant="globex")
    own = client.generate(prompt, {"max_tokens": 2}, tenant="acme")
    assert (other.stats.chunk_hits, other.stats.chunk_misses) == (0, 1)
    assert (own.stats.chunk_hits, own.stats.chunk_misses) == (1, 0)


def test_metrics_parse_and_count(client, server):
    from prometheus_client.parser import text_string_to_metric_families

    client.generate(ask(PASSAGES[:1]), {"max_tokens": 2})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.base + "/metrics").text)}
    assert {"ragcache_requests", "ragcache_engine_jobs", "ragcache_ttft_seconds", "ragcache_prompt_tokens",
            "ragcache_generated_tokens", "ragcache_chunk_lookups", "ragcache_chunk_hit_ratio", "ragcache_store_bytes",
            "ragcache_store_entries", "ragcache_queue_depth", "ragcache_kv_rows"} <= set(families)
    assert server.metric("ragcache_requests_total", route="/v1/generate", status="200") >= 1
    assert server.metric("ragcache_ttft_seconds_count") >= 1
    assert server.metric("ragcache_prompt_tokens_total", kind="computed") > 0
    assert 0.0 <= server.metric("ragcache_chunk_hit_ratio") <= 1.0
    assert server.metric("ragcache_queue_depth") == 0
    assert server.metric("ragcache_kv_rows", kind="used") <= server.metric("ragcache_kv_rows", kind="reserved")


def test_eight_concurrent_requests_equal_one_at_a_time(server):
    things = ["lantern", "kite", "rice", "snow", "jazz", "tulip", "boat", "cheese", "film", "book", "wine", "dragon"]
    facts = [f"Fact {i}: the {w} festival takes place every year in town {i}." for i, w in enumerate(things)]
    # every chunk belongs to one set only, and each set is asked twice in all: below any CP-Tree
    # promotion, so both rounds take the same path through the planner
    sets = [[facts[2 * i], facts[2 * i + 1]] if i < 4 else [facts[4 + i]] for i in range(8)]
    questions = [f"Question {i}: what is described?" for i in range(8)]

    def call(i: int) -> list[int]:
        with RagCacheClient(server.base, api_key=KEY, tenant=f"t{i % 2}") as c:
            if i % 2:  # half of them streamed, so both paths run side by side
                "".join(c.stream(ask(sets[i], questions[i]), {"max_tokens": 6}))
                assert c.last_result is not None
                return c.last_result.token_ids
            return c.generate(ask(sets[i], questions[i]), {"max_tokens": 6}).token_ids

    one_by_one = [call(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(call, range(8)))
    assert together == one_by_one
    assert len({tuple(t) for t in one_by_one}) > 1  # the sets really differ


COUNT = {"prompt": {"question": "Count from 1 to 500, separated by commas."},
         "sampling": {"max_tokens": 1500}, "policy": "full"}
QUICK = {"prompt": {"question": "Hi?"}, "sampling": {"max_tokens": 2}}


def _quick_request_seconds(server) -> float:
    start = time.monotonic()
    assert httpx.post(server.base + "/v1/generate", json=QUICK, headers=AUTH, timeout=300).status_code == 200
    return time.monotonic() - start


def test_a_client_that_disconnects_cancels_its_generation(server):
    # 1500 tokens is a minute of decoding here; a cancelled one frees the engine at the next token
    before = server.metric("ragcache_engine_jobs_total", endpoint="generate", outcome="disconnected")
    with httpx.stream("POST", server.base + "/v1/generate", json={**COUNT, "stream": True}, headers=AUTH,
                      timeout=300) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
    assert _quick_request_seconds(server) < 15
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(server.base + "/v1/generate", json=COUNT, headers=AUTH, timeout=3)
    assert _quick_request_seconds(server) < 15
    after = server.metric("ragcache_engine_jobs_total", endpoint="generate", outcome="disconnected")
    assert after - before == 2


GOOD = {"prompt": {"chunks": [{"text": "x"}], "question": "Why?"}, "sampling": {"max_tokens": 4}}
JSON = {**AUTH, "content-type": "application/json"}


@pytest.mark.parametrize(
    "name,path,kwargs,status",
    [
        ("malformed-json", "/v1/generate", {"content": b"{not json", "headers": JSON}, 422),
        ("non-utf8", "/v1/generate", {"content": b'{"prompt": {"question": "\xff\xfe"}}', "headers": JSON}, 400),
        ("empty-body", "/v1/generate", {"content": b"", "headers": JSON}, 422),
        ("wrong-type", "/v1/generate", {"json": {**GOOD, "sampling": {"max_tokens": "many"}}}, 422),
        ("unknown-field", "/v1/generate", {"json": {**GOOD, "bogus": 1}}, 422),
        ("empty-question", "/v1/generate", {"json": {**GOOD, "prompt": {"question": "  "}}}, 400),
        ("huge-max-tokens", "/v1/generate", {"json": {**GOOD, "sampling": {"max_tokens": 10**7}}}, 422),
        ("too-many-chunks", "/v1/generate", {"json": {**GOOD, "prompt": {"question": "q", "chunks": ["a"] * 7}}},
         413),
        ("oversize-chunk", "/v1/generate", {"json": {**GOOD, "prompt": {"question": "q", "chunks": ["a" * 5000]}}},
         413),
        ("over-context", "/v1/generate", {"json": {**GOOD, "prompt": {"question": "q", "chunks": ["7 " * 1999] * 6}}},
         413),
        ("bad-key", "/v1/generate", {"json": GOOD, "headers": {"Authorization": "Bearer wrong"}}, 401),
        ("no-key", "/v1/generate", {"json": GOOD, "headers": {}}, 401),
        ("bad-tenant-field", "/v1/generate", {"json": {**GOOD, "tenant": "no spaces!"}}, 422),
        ("bad-tenant-header", "/v1/generate", {"json": GOOD, "headers": {**AUTH, "X-RagCache-Tenant": "a/b"}}, 422),
        ("bad-policy", "/v1/generate", {"json": {**GOOD, "policy": "magic"}}, 422),
        ("chat-empty-messages", "/v1/chat/completions", {"json": {"messages": []}}, 422),
        ("chat-n-2", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "q"}], "n": 2}},
         400),
        ("warm-oversize", "/v1/chunks/warm", {"json": {"chunks": ["a" * 5000]}}, 413),
    ],
)
def test_bad_inputs_get_documented_4xx_and_server_stays_healthy(server, name, path, kwargs, status):
    kwargs = {"headers": AUTH, **kwargs}
    response = httpx.post(server.base + path, timeout=120, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert httpx.get(server.base + "/health").json()["status"] == "ok"


def test_client_raises_typed_errors_with_the_servers_message(server):
    with RagCacheClient(server.base, api_key="nope") as bad:
        with pytest.raises(AuthenticationError):
            bad.stats()
    with RagCacheClient(server.base, api_key=KEY) as good:
        with pytest.raises(InvalidRequestError, match="limit is 6") as info:
            good.generate(ask(["a"] * 7))
        assert info.value.status == 413 and info.value.field == "prompt.chunks"
        with pytest.raises(InvalidRequestError) as info:
            list(good.stream(ask(["a"]), policy="nonsense"))
        assert info.value.status == 422 and info.value.field == "policy"
