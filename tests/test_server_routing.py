"""The HTTP API's own routing on Starlette (chatapp/server/routing.py): what FastAPI used to give us, kept.

The routes' answers are tested against a real engine in test_server_sdk.py and test_reliability_security.py;
here, what needs no engine: the serving process's imports, the OpenAPI document and its pages, the key on
the document, and the methods each route takes.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from starlette.testclient import TestClient

from chatapp.server.app import create_app


def _resolve(doc: dict[str, Any], ref: str) -> dict[str, Any]:
    prefix = "#/components/schemas/"
    assert ref.startswith(prefix), ref
    schema: dict[str, Any] = doc["components"]["schemas"][ref[len(prefix) :]]
    return schema


def test_the_server_is_imported_without_fastapi() -> None:
    """FastAPI's import cost ~0.15 s of CPU on the way to a first /health: nothing may bring it back."""
    code = "import sys, chatapp.server.run; print(sorted(m for m in sys.modules if m.split('.')[0] == 'fastapi'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_document_describes_each_route_from_its_declaration() -> None:
    with TestClient(create_app(None)) as http:
        doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "chatapp"
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = _resolve(doc, chat["requestBody"]["content"]["application/json"]["schema"]["$ref"])
    assert {"messages", "model", "temperature", "stream"} <= set(body["properties"])
    answer = chat["responses"]["200"]["content"]
    assert (
        "text/event-stream" in answer
        and "choices" in _resolve(doc, answer["application/json"]["schema"]["$ref"])["properties"]
    )
    error = _resolve(doc, chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"])
    assert "error" in error["properties"]
    model = doc["paths"]["/v1/models/{model_id}"]["get"]
    assert model["parameters"][0]["name"] == "model_id" and "404" in model["responses"]
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}
    }
    # no key: nothing to send, so no operation asks for one
    assert "securitySchemes" not in doc["components"]
    assert all("security" not in op for ops in doc["paths"].values() for op in ops.values())


def test_without_a_key_the_docs_pages_show_the_document() -> None:
    with TestClient(create_app(None)) as http:
        for path in ("/docs", "/redoc"):
            page = http.get(path)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "/openapi.json" in page.text


def test_with_a_key_the_document_needs_it_and_says_where_it_goes() -> None:
    with TestClient(create_app(None, api_key="sesame")) as http:
        refused = http.get("/openapi.json")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
        doc = http.get("/openapi.json", headers={"x-api-key": "sesame"}).json()
        assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404
    assert set(doc["components"]["securitySchemes"]) == {"HTTPBearer", "APIKeyHeader"}
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"HTTPBearer": []}, {"APIKeyHeader": []}] and "401" in chat["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]  # probes send no key


def test_each_route_takes_only_its_method() -> None:
    with TestClient(create_app(None)) as http:
        for method, path in (("HEAD", "/v1/models"), ("GET", "/v1/chat/completions"), ("POST", "/health")):
            answer = http.request(method, path)
            assert answer.status_code == 405, (method, path)
            if method != "HEAD":
                assert answer.json()["error"]["message"] == f"method {method} is not allowed on {path}"
