"""`GET /openapi.json`: a valid OpenAPI 3.1 document (schemathesis loads it), generated
from the request structs (their bounds included), declaring bearer authentication
exactly when the frontend requires a key. The fuzz test that runs it against a live
frontend is `tests/integration/frontend/test_frontend_fuzz.py`."""

from __future__ import annotations

from typing import Any

import schemathesis
from frontend_support import Frontend
from http_support import running_frontend, send

from dynamo.frontend.http.openapi import openapi_document
from dynamo.frontend.openai.protocol import INT32_MAX, INT64_MAX, INT64_MIN

OPERATIONS = {
    ("/v1/completions", "post"),
    ("/v1/chat/completions", "post"),
    ("/v1/responses", "post"),
    ("/v1/models", "get"),
    ("/v1/models/{model}", "get"),
    ("/health", "get"),
    ("/live", "get"),
    ("/metrics", "get"),
    ("/debug/kv", "get"),
    ("/openapi.json", "get"),
}


def operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, method) for path, item in document["paths"].items() for method in item}


async def test_the_document_is_served_and_loads(frontend: Frontend) -> None:
    reply = await send(frontend.url, "/openapi.json", method="GET")
    assert reply.status == 200
    document = reply.json
    assert document["openapi"].startswith("3.1")
    assert operations(document) == OPERATIONS
    schema = schemathesis.openapi.from_dict(document)  # validates the document
    assert schema["/v1/completions"]["POST"] is not None
    assert "security" not in document


def test_request_bounds_come_from_the_structs() -> None:
    schemas = openapi_document()["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]

    def bounds(field: str) -> tuple[Any, Any]:
        (number, _null) = props[field]["anyOf"]
        return number.get("minimum"), number.get("maximum")

    assert bounds("seed") == (INT64_MIN, INT64_MAX)
    assert bounds("top_k") == (-INT32_MAX - 1, INT32_MAX)
    assert bounds("max_tokens") == (1, INT32_MAX)
    assert bounds("temperature") == (0.0, 2.0)
    assert "messages" in schemas["ChatCompletionRequest"]["required"]


async def test_with_an_api_key_operations_declare_bearer_auth(tokenizer: Any) -> None:
    async with running_frontend(tokenizer, api_key="sk-doc") as frontend:
        assert (await send(frontend.url, "/openapi.json", method="GET")).status == 401
        reply = await send(
            frontend.url,
            "/openapi.json",
            method="GET",
            headers={"Authorization": "Bearer sk-doc"},
        )
    document = reply.json
    assert document["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert document["security"] == [{"bearerAuth": []}]
    for path, item in document["paths"].items():
        for operation in item.values():
            if path in ("/health", "/live", "/metrics"):
                assert operation["security"] == [] and "401" not in operation["responses"]
            else:
                assert "401" in operation["responses"], path
    schemathesis.openapi.from_dict(document)
