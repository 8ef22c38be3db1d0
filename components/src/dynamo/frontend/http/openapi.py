"""The frontend's OpenAPI 3.1 document, served at `GET /openapi.json`.

Request and response bodies are described by the same `msgspec.Struct`s that decode and
encode them (`openai/protocol.py`, `errors.py`), through `msgspec.json.schema_components`,
so the document cannot drift from what the server accepts: every range bound there is a
`minimum`/`maximum` here. The rest (routes, statuses, headers, the operational
endpoints' small bodies) is written out below and checked against the live server by the
fuzz test (`tests/integration/frontend/test_frontend_fuzz.py`), which generates requests
from this document and validates every response against it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo.frontend.openai.errors import ErrorBody
from dynamo.frontend.openai.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelInfo,
    ModelList,
)
from dynamo.frontend.openai.responses_protocol import ResponseObject, ResponsesRequest

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{name}"
_SECURITY_SCHEME = "bearerAuth"

_JSON = "application/json"
_SSE = "text/event-stream"

# What the SSE parser of a client sees per event: `data` is one JSON chunk (or an error
# object after the stream started), and the last event's data is the literal `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {
            "type": "string",
            "description": 'A JSON chunk; an in-band error `{"error": {...}}`; or `[DONE]`.',
        },
    },
    "required": ["data"],
}

_HEALTH = {
    "type": "object",
    "properties": {
        "status": {"enum": ["healthy", "unhealthy"]},
        "models": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {"instances": {"type": "array", "items": {"type": "integer"}}},
                "required": ["instances"],
            },
        },
    },
    "required": ["status", "models"],
}

_RETRY_AFTER = {
    "description": "Seconds to wait before retrying (overload only).",
    "schema": {"type": "integer", "minimum": 0},
}
_WWW_AUTHENTICATE = {"description": "`Bearer`", "schema": {"type": "string"}}


def openapi_document(*, api_key_required: bool = False) -> dict[str, Any]:
    """The document as a JSON-able dict; with `api_key_required`, every operation but
    the probes (`/health`, `/live`, `/metrics`) declares bearer authentication and 401."""
    types = (CompletionRequest, ChatCompletionRequest, Completion, ChatCompletion)
    types += (ModelList, ModelInfo, ErrorBody, ChatCompletionChunk)
    types += (ResponsesRequest, ResponseObject)
    refs, schemas = msgspec.json.schema_components(types, ref_template=_REF)
    # ChatCompletionChunk is listed for the reader (the shape of each streamed chat
    # event's data); no operation refers to it.
    (completion_req, chat_req, completion, chat, model_list, model_info, error, _) = refs[:8]
    responses_req, response_object = refs[8:]
    paths = _Paths(error, api_key_required)
    _add_generation(paths, "completions", completion_req, completion, "Create a completion")
    _add_generation(paths, "chat/completions", chat_req, chat, "Create a chat completion")
    _add_generation(paths, "responses", responses_req, response_object, "Create a response")
    _add_models(paths, model_list, model_info)
    _add_operational(paths)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "Dynamo frontend",
            "version": "1",
            "description": "OpenAI-compatible API of `python -m dynamo.frontend`.",
        },
        "paths": paths.paths,
        "components": {"schemas": schemas},
    }
    if api_key_required:
        document["components"]["securitySchemes"] = {
            _SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}
        }
        document["security"] = [{_SECURITY_SCHEME: []}]
    return document


def _add_generation(
    paths: _Paths, route: str, request: dict[str, Any], response: dict[str, Any], summary: str
) -> None:
    paths.add(
        "post",
        f"/v1/{route}",
        summary,
        request_body=request,
        responses={
            "200": _content(
                "The completion; with `stream: true`, server-sent events whose data are "
                "chunks of it, ending with `data: [DONE]`.",
                {_JSON: response, _SSE: _SSE_EVENT},
            ),
            "400": "Invalid request; `param` names the field.",
            "404": "Unknown model.",
            "408": "The request body did not arrive in time.",
            "413": "The request body is larger than `--max-request-bytes`.",
            "500": "The worker failed the request.",
            "503": "No worker became ready in time, or the model is overloaded.",
        },
    )


def _add_models(paths: _Paths, model_list: dict[str, Any], model_info: dict[str, Any]) -> None:
    paths.add("get", "/v1/models", "List the served models", responses={"200": model_list})
    paths.add(
        "get",
        "/v1/models/{model}",
        "Describe one served model",
        parameters=[
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        responses={"200": model_info, "404": "Unknown model."},
    )


def _add_operational(paths: _Paths) -> None:
    """Probes (exempt from the API key), the KV routers' view, this document."""
    paths.add(
        "get",
        "/health",
        "Readiness: 200 when some model has a worker",
        responses={"200": _HEALTH, "503": _content("No model has a worker.", {_JSON: _HEALTH})},
        exempt=True,
    )
    paths.add(
        "get",
        "/live",
        "Liveness: 200 while the process serves HTTP",
        responses={"200": {"type": "object", "properties": {"status": {"const": "live"}}}},
        exempt=True,
    )
    paths.add(
        "get",
        "/metrics",
        "Prometheus metrics",
        responses={"200": _content("Prometheus text format.", {"text/plain": {"type": "string"}})},
        exempt=True,
    )
    paths.add(
        "get",
        "/debug/kv",
        "What each KV router believes, per model and worker endpoint; for models with "
        "prefill workers, the prefill placement policy and its decisions",
        responses={
            "200": {
                "type": "object",
                "properties": {
                    "models": {"type": "object"},
                    "disaggregation": {"type": "object"},
                },
            }
        },
    )
    paths.add("get", OPENAPI_PATH, "This document", responses={"200": {"type": "object"}})


def _content(description: str, media: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {k: {"schema": v} for k, v in media.items()}}


class _Paths:
    """Collects operations, adding the error responses every operation shares."""

    def __init__(self, error: dict[str, Any], api_key_required: bool) -> None:
        self.paths: dict[str, dict[str, Any]] = {}
        self._error = error
        self._api_key_required = api_key_required

    def add(
        self,
        method: str,
        path: str,
        summary: str,
        *,
        responses: dict[str, Any],
        request_body: dict[str, Any] | None = None,
        parameters: list[dict[str, Any]] | None = None,
        exempt: bool = False,
    ) -> None:
        operation: dict[str, Any] = {"summary": summary, "responses": {}}
        for status, spec in responses.items():
            operation["responses"][status] = self._response(status, spec)
        if self._api_key_required:
            if exempt:
                operation["security"] = []
            else:
                operation["responses"]["401"] = self._response(
                    "401", "Missing or incorrect API key."
                )
        if request_body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {_JSON: {"schema": request_body}},
            }
        if parameters:
            operation["parameters"] = parameters
        self.paths.setdefault(path, {})[method] = operation

    def _response(self, status: str, spec: Any) -> dict[str, Any]:
        """A response object from a description (an error), a schema (JSON) or a
        ready response object (one with `content`)."""
        if isinstance(spec, dict) and "content" in spec:
            return spec
        if isinstance(spec, dict):
            return {"description": "OK", "content": {_JSON: {"schema": spec}}}
        response: dict[str, Any] = {
            "description": spec,
            "content": {_JSON: {"schema": self._error}},
        }
        if status == "503":
            response["headers"] = {"Retry-After": _RETRY_AFTER}
        if status == "401":
            response["headers"] = {"WWW-Authenticate": _WWW_AUTHENTICATE}
        return response
