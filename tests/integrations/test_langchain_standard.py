"""LangChain's own standard test suite against ChunkCachedChatModel on the real SmolLM2 engine.

Declared honestly: no tool calling, no structured output / JSON mode, text inputs only (image,
audio, PDF blocks are rejected with a clear error). Usage metadata is reported (prompt and
generated token counts, and the prompt tokens read from the cache as `cache_read`). The suite's
model-override tests are off: the engine serves one model.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import pytest

pytest.importorskip("langchain_tests")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from ragcache_integrations.langchain import ChunkCachedChatModel  # noqa: E402


@functools.cache
def shared_engine() -> Any:
    # the suite builds the model many times from params: all of them share one real engine
    import tempfile

    from engine_sidecar import Engine

    return Engine.from_pretrained("default", device="cpu", dtype="float32",
                                  cache_dir=tempfile.mkdtemp(prefix="ragcache-lc-standard-"))


class _Declared:
    @property
    def chat_model_class(self) -> type[ChunkCachedChatModel]:
        return ChunkCachedChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": shared_engine(), "model": "SmolLM2-135M-Instruct"}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict[Any, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}


class TestChunkCachedChatModelUnit(_Declared, ChatModelUnitTests):
    pass


class TestChunkCachedChatModelIntegration(_Declared, ChatModelIntegrationTests):
    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        # a known passage asked about twice: the second call reads its KV from the cache
        passage = Document(id="standard-suite-nile", page_content="The Nile flows north through Egypt into the "
                           "Mediterranean Sea, ending in a wide, fertile delta.")
        model = ChunkCachedChatModel(engine=shared_engine(), max_tokens=4)
        model.remember([passage])
        question = f"Context:\n{passage.page_content}\n\nQuestion: Where does the Nile flow?"
        model.invoke(question)
        message = functools.reduce(operator.add, model.stream(question)) if stream else model.invoke(question)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0  # not just the key: the reuse
        return message
