"""HTTP helpers for the frontend's hardening tests: requests with raw bodies and headers,
frontends started with non-default limits, and the OpenAI error shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from frontend_support import MODEL, Frontend, start_frontend
from multidict import CIMultiDictProxy


@dataclass
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


async def send(
    url: str,
    path: str,
    body: Any = None,
    *,
    method: str = "POST",
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """One request; `body` is JSON-encoded unless it is bytes already."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url + path, data=data, headers=all_headers) as resp,
    ):
        return Reply(resp.status, resp.headers, await resp.read())


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Say hello", **fields}


def assert_openai_error(reply: Reply, status: int, *, param: str | None = None) -> Any:
    """The reply is OpenAI's error shape with `status` (and `param`); returns the error."""
    assert reply.status == status, reply.raw
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.json
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


@asynccontextmanager
async def running_frontend(tokenizer: Any, **service_kwargs: Any) -> AsyncIterator[Frontend]:
    """A frontend over the scripted engine with `HttpService` options of the test's own."""
    frontend = await start_frontend(tokenizer, **service_kwargs)
    try:
        yield frontend
    finally:
        await frontend.service.stop()
        await frontend.manager.close()


def metric_value(frontend: Frontend, name: str, **labels: str) -> float:
    """One sample of the frontend's registry (0 when the series has no such sample)."""
    value = frontend.service.metrics.registry.get_sample_value(name, labels)
    return value or 0.0
