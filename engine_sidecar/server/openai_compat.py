"""What `/v1/chat/completions` does not do, refused in words that name it.

OpenAI clients and frameworks send some of these parameters by default at neutral values
(`n=1`, penalties 0, `logprobs=false`, `tools=[]`, `response_format={"type": "text"}`): those
pass, as they ask for nothing. Anything that asks for the feature is a 400 naming it and saying
what to do instead, never pydantic's "Extra inputs are not permitted". Legacy completions and
embeddings get 404s of their own that point to the routes this sidecar serves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_sidecar.server.errors import ApiError
from ragcache_integrations.api_models import ChatCompletionRequest

UNSUPPORTED_FEATURE = "unsupported_feature"
UNSUPPORTED_ENDPOINT = "unsupported_endpoint"


@dataclass(frozen=True)
class Unsupported:
    """An OpenAI feature this endpoint refuses: the request fields that ask for it, each field's
    values that ask for nothing, and the refusal's message."""

    fields: tuple[str, ...]
    neutral: tuple[Any, ...]
    message: str

    def asked_by(self, body: ChatCompletionRequest) -> str | None:
        """The first field of `body` that asks for this feature, if any."""
        for field in self.fields:
            value = getattr(body, field)
            # `in` would take True for 1 and False for 0: compare types too
            if not any(type(value) is type(n) and value == n for n in self.neutral):
                return field
        return None


_TOOL_MESSAGE = ("tool calling is not supported by this endpoint (tools, tool_choice, functions, function_call): "
                 "describe the tools in the prompt and parse the answer, or call a model server that supports tools")

UNSUPPORTED: tuple[Unsupported, ...] = (
    # with no tools, "auto" and "none" ask for no tool call (and parallel_tool_calls, accepted, for nothing)
    Unsupported(("tools", "functions"), (None, []), _TOOL_MESSAGE),
    Unsupported(("tool_choice", "function_call"), (None, "none", "auto"), _TOOL_MESSAGE),
    Unsupported(("response_format",), (None, {"type": "text"}),
                "structured output / JSON mode (response_format) is not supported by this endpoint: ask for JSON "
                "in the prompt and validate the answer yourself"),
    Unsupported(("logprobs", "top_logprobs"), (None, False, 0),
                "logprobs are not returned by this endpoint: leave logprobs unset or false, top_logprobs unset "
                "or 0"),
    Unsupported(("frequency_penalty", "presence_penalty"), (None, 0, 0.0),
                "frequency_penalty / presence_penalty are not supported by this endpoint: leave them unset or 0; "
                "sampling takes temperature, top_p, seed and stop"),
    Unsupported(("logit_bias",), (None, {}),
                "logit_bias is not supported by this endpoint: leave it unset or empty"),
    Unsupported(("n",), (None, 1), "n > 1 is not supported: send one request per answer (with temperature > 0 "
                                   "and a different seed each)"),
)


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """A 400 naming the first feature the request asks for that this endpoint does not do."""
    for feature in UNSUPPORTED:
        field = feature.asked_by(body)
        if field is not None:
            raise ApiError(400, feature.message, field, UNSUPPORTED_FEATURE)


def unsupported_route(name: str, path: str) -> ApiError:
    return ApiError(404, f"{name} ({path}) are not served by this sidecar: use /v1/chat/completions (OpenAI chat "
                         "format) or /v1/generate (chunk-structured prompts)", None, UNSUPPORTED_ENDPOINT)
