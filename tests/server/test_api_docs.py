"""docs/api.md is checked against the OpenAPI schema: every path and method is documented."""

from __future__ import annotations

from pathlib import Path

from engine_sidecar.server import create_app

DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()


def test_every_openapi_path_is_documented_with_a_curl_example(tiny_engine):
    schema = create_app(tiny_engine).openapi()
    for path, methods in schema["paths"].items():
        for method in methods:
            assert f"`{method.upper()} {path}`" in DOC, f"{method.upper()} {path} missing from docs/api.md"
            assert f"localhost:8808{path}" in DOC, f"no curl example for {path}"
