"""docs/api.md is checked against what the server really exposes: the OpenAPI schema (paths,
methods, request fields, error statuses), the Prometheus metric names and the serve flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine_sidecar.server import create_app
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
    for name in (n for n in names if not n.endswith("_created")):  # client-library timestamps
        counter = f"{name}_total"
        assert f"`{name}`" in DOC or f"`{counter}`" in DOC, f"metric {name} not documented"


def test_every_serve_flag_is_documented():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = [opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")]
    missing = [f for f in flags if f not in DOC and f != "--help"]
    assert not missing, f"serve flags not in docs/api.md: {missing}"
