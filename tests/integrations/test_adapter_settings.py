"""What a user passes to an adapter is used or refused, never dropped: the client settings its
anchors take (`OpenAILike`, `ChatOpenAI`), the sidecar address from the environment, every
sampling option on every adapter, and model facts fetched again until the sidecar answers. Against
a real `ragcache serve` with a tiny model."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from ragcache_integrations.client import APIConnectionError, APITimeoutError, AuthenticationError
from ragcache_integrations.langchain import ChunkCachedChatModel, ChunkCachedRunnable
from ragcache_integrations.llama_index import ChunkCachedLLM
from tests.server.test_server_process import ServerProcess

DOCS = {"input": "How high is Mount Fuji?", "context": ["Mount Fuji is 3,776 m high.", "The Nile flows north."]}


@pytest.fixture(scope="module")
def sidecar(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-settings")
    with ServerProcess(tiny_llama_dir, root / "kv", root / "serve.log") as proc:
        yield proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ADAPTERS = {
    "llama_index": lambda **kw: ChunkCachedLLM(max_tokens=4, **kw),
    "langchain_chat": lambda **kw: ChunkCachedChatModel(max_tokens=4, **kw),
    "langchain_runnable": lambda **kw: ChunkCachedRunnable(max_tokens=4, **kw),
}


def _ask(name: str, adapter) -> str:
    if name == "llama_index":
        return adapter.complete("How high is Mount Fuji?").text
    if name == "langchain_chat":
        return str(adapter.invoke("How high is Mount Fuji?").content)
    return adapter.invoke(DOCS)


@pytest.mark.parametrize("name", ADAPTERS)
def test_a_tiny_timeout_is_used_not_dropped(sidecar, name):
    with pytest.raises(APITimeoutError):
        _ask(name, ADAPTERS[name](base_url=sidecar.base, timeout=1e-6, max_retries=0))
    assert isinstance(_ask(name, ADAPTERS[name](base_url=sidecar.base, timeout=60, max_retries=0)), str)


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_address_and_key_come_from_the_environment(sidecar, monkeypatch, name):
    monkeypatch.setenv("RAGCACHE_BASE_URL", sidecar.base + "/v1")  # an OpenAI-style URL works too
    monkeypatch.setenv("RAGCACHE_API_KEY", "unused-without-auth")
    assert isinstance(_ask(name, ADAPTERS[name]()), str)
    assert isinstance(_ask(name, ADAPTERS[name](api_base=sidecar.base)), str)


@pytest.mark.parametrize("name", ["llama_index", "langchain_chat"])
def test_an_unknown_setting_is_an_error(name):
    with pytest.raises((ValidationError, TypeError), match="bogus_option"):
        ADAPTERS[name](base_url="http://127.0.0.1:1", bogus_option=1)


def test_the_runnable_takes_every_sampling_option(sidecar):
    runnable = ChunkCachedRunnable(base_url=sidecar.base, max_tokens=6, temperature=0.7, top_p=0.9, seed=3,
                                   stop=["\n\n\n"], timeout=60, max_retries=0)
    first, second = runnable.invoke(DOCS), runnable.invoke(DOCS)
    assert first == second  # seeded: the same draw twice
    with pytest.raises(TypeError, match="bogus"):
        ChunkCachedRunnable(base_url=sidecar.base, bogus=1)


def test_model_facts_are_fetched_again_until_the_sidecar_answers(tiny_llama_dir, tmp_path):
    port = _free_port()
    llm = ChunkCachedLLM(base_url=f"http://127.0.0.1:{port}", max_tokens=4, max_retries=0)
    assert llm.metadata.model_name == "ragcache"  # nothing known yet: a placeholder
    with ServerProcess(tiny_llama_dir, tmp_path / "kv", tmp_path / "serve.log", port=port) as proc:
        assert proc.base.endswith(str(port))
        facts = llm.metadata
        assert facts.model_name == tiny_llama_dir.name and facts.context_window == 2048
        assert llm.count_tokens("Mount Fuji") < len("Mount Fuji")  # the real tokenizer, not 4 chars a token


def test_a_refused_connection_names_the_address(tiny_llama_dir):
    address = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(APIConnectionError, match="ragcache serve"):
        ChunkCachedLLM(base_url=address, max_tokens=4).complete("hi")


def test_tool_binding_says_why_it_is_not_supported():
    with pytest.raises(NotImplementedError, match="tool calling"):
        ChunkCachedChatModel(base_url="http://127.0.0.1:1").bind_tools([])


@pytest.fixture(scope="module")
def keyed_sidecar(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-headers")
    with ServerProcess(tiny_llama_dir, root / "kv", root / "serve.log", "--api-key", "gateway-key") as proc:
        yield proc


@pytest.mark.parametrize("name", ADAPTERS)
def test_default_headers_go_with_every_request(keyed_sidecar, monkeypatch, name):
    """A gateway's header reaches the sidecar: here its Authorization opens a keyed sidecar, which
    the same adapter without the header cannot use."""
    monkeypatch.delenv("RAGCACHE_API_KEY", raising=False)
    with pytest.raises(AuthenticationError):
        _ask(name, ADAPTERS[name](base_url=keyed_sidecar.base, max_retries=0))
    headers = {"Authorization": "Bearer gateway-key", "X-Trace-Id": "t-1"}
    assert isinstance(_ask(name, ADAPTERS[name](base_url=keyed_sidecar.base, default_headers=headers)), str)


EXTRA_SAMPLING = {"llama_index": "additional_kwargs", "langchain_chat": "model_kwargs",
                  "langchain_runnable": "additional_kwargs"}


@pytest.mark.parametrize("name", ADAPTERS)
def test_extra_sampling_options_are_used_and_override_the_fields(sidecar, name):
    # max_tokens=4 from the field, 7 from the extra options; ignore_eos makes the count exact
    adapter = ADAPTERS[name](base_url=sidecar.base, **{EXTRA_SAMPLING[name]: {"max_tokens": 7, "ignore_eos": True}})
    _ask(name, adapter)
    assert adapter.last_stats["decode_tokens"] == 7


@pytest.mark.parametrize("name", ADAPTERS)
def test_an_extra_option_the_engine_does_not_know_is_refused_by_name(name):
    with pytest.raises(ValueError, match="logit_bias.*ignore_eos"):
        ADAPTERS[name](base_url="http://127.0.0.1:1", **{EXTRA_SAMPLING[name]: {"logit_bias": {}}})
    with pytest.raises(ValueError, match="sidecar"):
        ADAPTERS[name](engine=object(), default_headers={"X-Trace-Id": "t"})
