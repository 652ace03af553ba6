"""docs/integrations.md's option lists are checked against the adapters' real signatures: every
option it says every adapter takes is accepted by each of them (a documented option that an
adapter silently dropped or refused was a first-day trap)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from ragcache_integrations.langchain import ChunkCachedChatModel, ChunkCachedRunnable
from ragcache_integrations.llama_index import ChunkCachedLLM

DOC = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()


def _paragraph(start: str) -> str:
    begin = DOC.index(start)
    return DOC[begin: DOC.index("\n\n", begin)]


def _names(text: str) -> set[str]:
    # `name` or `name=`, skipping values (`cacheblend[...]`, `$ENV`, `/v1`, `preserve`...)
    return {m for m in re.findall(r"`([a-z_]+)=?`", text)}


COMMON = {"policy", "order", "tenant", "max_tokens", "temperature", "top_p", "stop", "seed", "conversation_id"}
CLIENT = {"base_url", "api_base", "api_key", "timeout", "max_retries", "default_headers"}
EXTRA_SAMPLING = {ChunkCachedLLM: "additional_kwargs", ChunkCachedChatModel: "model_kwargs",
                  ChunkCachedRunnable: "additional_kwargs"}


def _accepted(adapter: type) -> set[str]:
    params = set(inspect.signature(adapter.__init__).parameters)
    fields = getattr(adapter, "model_fields", {})
    aliases = {f.alias for f in fields.values() if getattr(f, "alias", None)}
    return params | set(fields) | aliases


def test_the_documented_lists_are_the_ones_checked():
    assert COMMON <= _names(_paragraph("Common options:"))
    assert CLIENT <= _names(_paragraph("Client options, as OpenAI clients name them:"))


@pytest.mark.parametrize("adapter", [ChunkCachedLLM, ChunkCachedChatModel, ChunkCachedRunnable],
                         ids=lambda a: a.__name__)
def test_every_adapter_takes_every_documented_option(adapter):
    missing = (COMMON | CLIENT) - _accepted(adapter)
    assert not missing, f"{adapter.__name__} lacks documented options {sorted(missing)}"


@pytest.mark.parametrize("adapter", [ChunkCachedLLM, ChunkCachedChatModel], ids=lambda a: a.__name__)
def test_model_is_a_label_on_the_pydantic_adapters(adapter):
    assert "model" in _accepted(adapter)


@pytest.mark.parametrize("adapter", [ChunkCachedLLM, ChunkCachedChatModel, ChunkCachedRunnable],
                         ids=lambda a: a.__name__)
def test_each_adapter_takes_extra_sampling_options_under_the_documented_name(adapter):
    name = EXTRA_SAMPLING[adapter]
    paragraph = _paragraph("More sampling options for every call")
    assert f"`{name}`" in paragraph and f"`{adapter.__name__}`" in paragraph
    assert name in _accepted(adapter)
