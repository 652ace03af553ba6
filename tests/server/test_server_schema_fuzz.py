"""Schema fuzzing of a real `ragcache serve`: schemathesis drives every operation of
the server's own OpenAPI schema with bounded, derandomized examples. No input may give a 5xx, and
every response, each server-sent event of a stream included, must match the schema.

One sidecar per module with the tiny random model and small limits (8 tokens per answer, small
bodies), so the whole run stays within a few minutes on two cores."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from engine_sidecar.server import ServerSettings, create_app
from tests.server.test_server_process import ServerProcess

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    with ServerProcess(tiny_llama_dir, folder / "kv", folder / "log", "--max-tokens", "8", "--max-chunks", "4",
                       "--max-chunk-chars", "400", "--max-body-mb", "0.05", "--request-timeout", "60") as server:
        yield server
    assert "Traceback" not in server.log(), server.log_tail(60)


# The schema is built in process (routes and models only: no engine needed) so the operations can
# be parametrized at collection time; the first test checks the server serves exactly this one.
# (schemathesis' pytest.from_fixture, which would read it from the server, fails on pytest 9.)
OPENAPI = create_app(None, ServerSettings()).openapi()  # type: ignore[arg-type]
schema = schemathesis.openapi.from_dict(OPENAPI)


def test_the_server_serves_the_schema_being_fuzzed(server):
    assert httpx.get(server.base + "/openapi.json", timeout=30).json() == OPENAPI


@schema.parametrize()
@settings(max_examples=30, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_a_server_error_and_every_response_matches_the_schema(case, server):
    case.call_and_validate(base_url=server.base, checks=CHECKS, timeout=60)


@pytest.mark.parametrize("path,body", [
    ("/v1/generate", {"prompt": {"chunks": ["A passage."], "question": "Why?"}, "sampling": {"max_tokens": 4},
                      "stream": True}),
    ("/v1/generate", {"prompt": {"question": "Why?"}, "sampling": {"max_tokens": 4}, "stream": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi?"}], "chunks": ["A passage."],
                              "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 4}),
])
def test_streamed_and_json_responses_match_the_schema(server, path, body):
    """Every server-sent event is checked against the schema's text/event-stream description."""
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call_and_validate(base_url=server.base, checks=CHECKS, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith("text/event-stream" if body.get("stream") else
                                                          "application/json")
