"""docs/api.md is checked against what the server really exposes: the OpenAPI schema (paths,
methods, request fields, error statuses), the Prometheus metric names and the serve flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine_sidecar.server import create_app
from engine_sidecar.server.openai_compat import UNSUPPORTED
from engine_sidecar.server.serve_args import add_serve_arguments

DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
HEADER = re.compile(r"^### `(GET|HEAD|POST|PUT|PATCH|DELETE) (/\S*)`$", re.M)


@pytest.fixture(scope="module")
def app(tiny_llama_dir, tmp_path_factory):
    from engine_sidecar import Engine

    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32",
                                    cache_dir=tmp_path_factory.mktemp("docs-kv"))
    yield create_app(engine)
    engine.close()


@pytest.fixture(scope="module")
def schema(app) -> dict:
    return app.openapi()


def _section(method: str, path: str) -> str:
    start = DOC.index(f"### `{method} {path}`")
    body = DOC.index("\n", start)
    following = re.search(r"^##+ ", DOC[body:], re.M)
    return DOC[start: body + following.start()] if following else DOC[start:]


def _operations(schema: dict) -> list[tuple[str, str, dict]]:
    return [(m.upper(), p, op) for p, ops in schema["paths"].items() for m, op in ops.items()]


def test_every_operation_has_a_section_with_a_curl_example(schema):
    for method, path, _ in _operations(schema):
        assert f"### `{method} {path}`" in DOC, f"{method} {path} is not documented"
        section = _section(method, path)
        curl = [line for line in section.splitlines() if line.startswith("curl ") and f"localhost:8808{path}" in line]
        assert curl, f"no curl example for {method} {path}"
        if method not in ("GET", "POST"):
            assert any(f"-X {method}" in line for line in curl)


def test_every_documented_section_exists(schema):
    documented = set(HEADER.findall(DOC))
    assert documented == {(m, p) for m, p, _ in _operations(schema)}


def test_request_fields_are_documented_where_they_are_used(schema):
    components = schema["components"]["schemas"]
    for method, path, op in _operations(schema):
        ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
        if not ref:
            continue
        fields = components[ref.rsplit("/", 1)[1]]["properties"]
        section = _section(method, path)
        missing = [name for name in fields if f"`{name}`" not in section]
        assert not missing, f"{method} {path}: fields {missing} not documented"


def test_every_error_status_is_in_the_error_table(schema):
    statuses = {s for _, _, op in _operations(schema) for s in op["responses"] if s.startswith(("4", "5"))}
    for status in statuses:
        assert re.search(rf"^\| {status}\b", DOC, re.M), f"status {status} missing from the error table"


def test_every_metric_is_documented(app):
    from prometheus_client.parser import text_string_to_metric_families

    with TestClient(app) as client:
        client.post("/v1/generate", json={"prompt": {"question": "Hi?"}, "sampling": {"max_tokens": 1}})
        names = {f.name for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in names:
        counter = f"{name}_total"
        assert f"`{name}`" in DOC or f"`{counter}`" in DOC, f"metric {name} not documented"


def test_every_serve_flag_is_documented():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = [opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")]
    missing = [f for f in flags if f not in DOC and f != "--help"]
    assert not missing, f"serve flags not in docs/api.md: {missing}"


# a value asking for each OpenAI feature the endpoint refuses, as an app would send it
ASKING = {"tools": [{"type": "function", "function": {"name": "f"}}], "functions": [{"name": "f"}],
          "tool_choice": "required", "function_call": {"name": "f"}, "response_format": {"type": "json_object"},
          "logprobs": True, "top_logprobs": 2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
          "logit_bias": {"42": 5}, "n": 2}
REFUSAL_ROW = re.compile(r'^\| (.+?) \| .+? \| (\d{3}) \| "(.+?)" \|$', re.M)


def _refusals() -> list[tuple[str, int, str]]:
    start = DOC.index("**What the OpenAI endpoint does not do.**")
    table = DOC[DOC.index("\n|", start): DOC.index("\n\n", DOC.index("|---", start))]
    return [(asked, int(status), message) for asked, status, message in REFUSAL_ROW.findall(table)]


def test_every_refusal_the_docs_list_is_what_the_server_answers(app):
    rows = _refusals()
    client = TestClient(app)  # no lifespan: refusals never reach the engine
    for asked, status, message in rows:
        routes = re.findall(r"`POST (/\S+)`", asked)
        fields = [] if routes else re.findall(r"`(\w+)`", asked)
        assert routes or fields, f"row names no field or route: {asked}"
        for path in routes:
            reply = client.post(path, json={"model": "m", "prompt": "x", "input": "x"})
            assert reply.status_code == status and reply.json()["error"]["message"].startswith(message), reply.text
        for field in fields:
            reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi?"}],
                                                              "max_tokens": 1, field: ASKING[field]})
            error = reply.json()["error"]
            assert (reply.status_code, error["param"]) == (status, field), reply.text
            assert error["message"].startswith(message), f"{field}: {error['message']!r}"
    documented = {f for asked, _, _ in rows if "`POST " not in asked for f in re.findall(r"`(\w+)`", asked)}
    assert documented == {f for feature in UNSUPPORTED for f in feature.fields}, "a refused field is not in the table"
    assert {path for asked, _, _ in rows for path in re.findall(r"`POST (/\S+)`", asked)} == {
        "/v1/completions", "/v1/embeddings"}
