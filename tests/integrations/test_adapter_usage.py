"""The adapters' token usage shows reuse the way each framework's OpenAI classes report it:
LangChain's `usage_metadata` with `input_token_details["cache_read"]`, LlamaIndex's counts in
`additional_kwargs` and OpenAI's `usage` shape in `raw` with `cached_tokens`. The tokens read
from the cache are the stats' `tokens_reused`. Structured output is refused by its own name.
Against a real `ragcache serve` with a tiny model."""

from __future__ import annotations

import functools
import operator

import pytest
from langchain_core.documents import Document
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.callbacks.token_counting import get_tokens_from_response
from llama_index.core.schema import TextNode

from ragcache_integrations.langchain import ChunkCachedChatModel
from ragcache_integrations.llama_index import ChunkCachedLLM
from ragcache_integrations.llama_index.observer import remember_nodes
from tests.server.test_server_process import ServerProcess

PASSAGE = "The Nile flows north through Egypt into the Mediterranean Sea, ending in a wide, fertile delta."
QUESTION = f"Context:\n{PASSAGE}\n\nQuestion: Where does the Nile flow?"


@pytest.fixture(scope="module")
def sidecar(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-usage")
    with ServerProcess(tiny_llama_dir, root / "kv", root / "serve.log") as proc:
        yield proc


def _counts(stats: dict) -> tuple[int, int, int]:
    return stats["prefill_tokens_total"], stats["decode_tokens"], stats["tokens_reused"]


def test_chat_model_usage_counts_the_prompt_tokens_read_from_the_cache(sidecar):
    model = ChunkCachedChatModel(base_url=sidecar.base, max_tokens=4, tenant="usage-langchain")
    model.remember([Document(id="nile", page_content=PASSAGE)])
    model.invoke(QUESTION)  # computes the passage and keeps its KV
    message = model.invoke(QUESTION)
    prompt, output, reused = _counts(model.last_stats)
    assert model.last_stats["chunk_hits"] == 1 and reused > 0
    assert message.usage_metadata == {"input_tokens": prompt, "output_tokens": output,
                                      "total_tokens": prompt + output, "input_token_details": {"cache_read": reused}}

    streamed = functools.reduce(operator.add, model.stream(QUESTION))
    assert streamed.usage_metadata is not None
    assert streamed.usage_metadata["input_token_details"] == {"cache_read": model.last_stats["tokens_reused"]}
    assert streamed.usage_metadata["input_tokens"] == model.last_stats["prefill_tokens_total"]


def test_llm_usage_counts_the_prompt_tokens_read_from_the_cache(sidecar):
    remember_nodes([TextNode(id_="nile", text=PASSAGE)])
    llm = ChunkCachedLLM(base_url=sidecar.base, max_tokens=4, tenant="usage-llama-index")
    llm.complete(QUESTION)  # computes the passage and keeps its KV
    response = llm.complete(QUESTION)
    stats = llm.last_stats
    prompt, output, reused = _counts(stats)
    assert stats["chunk_hits"] == 1 and reused > 0
    counts = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}
    assert response.additional_kwargs == {**counts, "cached_tokens": reused, "ragcache": stats}
    assert response.raw == {"usage": {**counts, "prompt_tokens_details": {"cached_tokens": reused}}}
    # LlamaIndex's token counting takes these instead of counting with its own tokenizer
    assert get_tokens_from_response(response) == (prompt, output)

    last = list(llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))[-1]
    assert last.delta == "" and last.additional_kwargs["cached_tokens"] == llm.last_stats["tokens_reused"] > 0
    assert last.raw["usage"]["prompt_tokens"] == llm.last_stats["prefill_tokens_total"]


@pytest.mark.parametrize("method", [None, "function_calling", "json_mode", "json_schema"])
def test_structured_output_is_refused_naming_structured_output(method):
    model = ChunkCachedChatModel(base_url="http://127.0.0.1:1")
    options = {"method": method} if method else {}
    schema = {"title": "Answer", "type": "object", "properties": {"city": {"type": "string"}}}
    with pytest.raises(NotImplementedError, match=r"does not support structured output \(with_structured_output"
                       ) as refused:
        model.with_structured_output(schema, **options)
    assert (f"method={method!r}" in str(refused.value)) == (method is not None)
    with pytest.raises(NotImplementedError, match="tool calling"):  # tools keep their own refusal
        model.bind_tools([])
