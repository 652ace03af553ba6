"""What OpenAI tooling sees from a real `ragcache serve`, through the `openai` client: reuse as
`usage.prompt_tokens_details.cached_tokens`, streamed and not, and refusals that name the
feature a request asks for (neutral defaults still pass)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from tests.server.test_server_process import ServerProcess  # noqa: E402

PASSAGES = ["The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
            "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres."]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    with ServerProcess(tiny_llama_dir, root / "kv", root / "log") as proc:
        yield proc.base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def ask(client, question: str, chunks: list[str] | None = None, **kw):
    extra = {"chunks": chunks} if chunks is not None else {}
    return client.chat.completions.create(model="ragcache", messages=[{"role": "user", "content": question}],
                                          max_tokens=2, extra_body=extra, **kw)


def test_cached_tokens_are_the_reused_tokens(client):
    first = ask(client, "Which river reaches the Atlantic?", PASSAGES)
    again = ask(client, "Which mountain is highest?", PASSAGES[::-1])
    for reply in (first, again):
        stats = reply.model_extra["ragcache"]
        assert reply.usage.prompt_tokens_details.cached_tokens == stats["tokens_reused"]
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    plain = ask(client, "Hello?")
    assert plain.usage.prompt_tokens_details.cached_tokens == 0


def test_a_streamed_answer_reports_cached_tokens_in_its_usage_chunk(client):
    ask(client, "Which river reaches the Atlantic?", PASSAGES)
    stream = ask(client, "Where is Kilimanjaro?", PASSAGES[::-1], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    stats = next(c.model_extra["ragcache"] for c in chunks if c.model_extra.get("ragcache"))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens == stats["tokens_reused"] > 0


@pytest.mark.parametrize(("options", "words", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "tool calling", "tools"),
    ({"tool_choice": "required"}, "tool calling", "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "tool calling", "functions"),
    ({"function_call": {"name": "f"}}, "tool calling", "function_call"),
    ({"response_format": {"type": "json_object"}}, "structured output / JSON mode", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
     "structured output / JSON mode", "response_format"),
    ({"logprobs": True}, "logprobs", "logprobs"),
    ({"top_logprobs": 3}, "logprobs", "top_logprobs"),
    ({"frequency_penalty": 0.5}, "frequency_penalty / presence_penalty", "frequency_penalty"),
    ({"presence_penalty": 1.0}, "frequency_penalty / presence_penalty", "presence_penalty"),
    ({"logit_bias": {"42": 5}}, "logit_bias", "logit_bias"),
    ({"n": 2}, "n > 1", "n"),
    ({"n": 2, "stream": True}, "n > 1", "n"),  # refused before the stream starts: a plain 400
])
def test_an_unsupported_feature_is_refused_by_name(client, options, words, param):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, "Hello?", **options)
    assert refused.value.status_code == 400 and words in refused.value.message
    assert "not supported" in refused.value.message or "not returned" in refused.value.message
    assert refused.value.body["param"] == param and refused.value.body["code"] == "unsupported_feature"


def test_neutral_values_clients_send_by_default_pass(client):
    neutral = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "top_logprobs": 0,
               "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": {}}
    reply = ask(client, "Hello?", **neutral)
    assert reply.choices[0].message.content is not None
    streamed = list(ask(client, "Hello?", stream=True, stream_options={"include_usage": True},
                        parallel_tool_calls=True, **{**neutral, "tool_choice": "auto"}))
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens > 0


def test_unserved_openai_routes_say_so(client):
    with pytest.raises(openai.NotFoundError) as completions:
        client.completions.create(model="ragcache", prompt="Hello")
    with pytest.raises(openai.NotFoundError) as embeddings:
        client.embeddings.create(model="ragcache", input="Hello")
    for refused, words in ((completions, "legacy completions (/v1/completions)"),
                           (embeddings, "embeddings (/v1/embeddings)")):
        assert words in refused.value.message and "/v1/chat/completions" in refused.value.message
        assert refused.value.body["code"] == "unsupported_endpoint"
