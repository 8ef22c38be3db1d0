"""The optional API key: without it every route but the probes is 401 in OpenAI's shape
with `WWW-Authenticate: Bearer`; with it everything works, including the official client;
the key shows up in no log, no response and no `--help`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from frontend_support import MODEL, Frontend
from http_support import assert_openai_error, chat, metric_value, running_frontend, send

from dynamo.frontend.__main__ import build_parser, config_from_args
from dynamo.frontend.http.auth import ApiKeyCheck

KEY = "sk-test-9f8e7d6c5b4a"


@pytest.fixture
async def guarded(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Frontend]:
    caplog.set_level(logging.DEBUG)
    async with running_frontend(tokenizer, api_key=KEY) as frontend:
        yield frontend
    logged = [r.getMessage() for when in ("setup", "call") for r in caplog.get_records(when)]
    assert logged, "the frontend logs (at least its start); the check below must see them"
    assert not [line for line in logged if KEY in line], "the API key must never be logged"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("sk-wrong"),
        bearer(KEY[:-1]),  # a prefix of the key
        bearer(KEY + "x"),
        {"Authorization": KEY},  # no scheme
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer sk-\u00e9\u00e8"},  # not ASCII: compared as bytes, no 500
        {"X-Api-Key": KEY},
    ],
)
async def test_requests_without_the_key_get_401(guarded: Frontend, headers: dict[str, str]) -> None:
    reply = await send(guarded.url, "/v1/chat/completions", chat(), headers=headers)
    error = assert_openai_error(reply, 401)
    assert error["code"] == "invalid_api_key"
    assert reply.headers["WWW-Authenticate"] == "Bearer"
    assert KEY not in reply.raw.decode()
    assert guarded.client.requests == [], "nothing runs before authentication"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("GET", "/debug/kv"),
        ("GET", "/openapi.json"),
        ("POST", "/v1/completions"),
        ("GET", "/no/such/route"),  # unknown routes are not revealed either
    ],
)
async def test_every_route_but_the_probes_requires_the_key(
    guarded: Frontend, method: str, path: str
) -> None:
    reply = await send(guarded.url, path, method=method)
    assert_openai_error(reply, 401)


@pytest.mark.parametrize("path", ["/health", "/live", "/metrics"])
async def test_probes_need_no_key(guarded: Frontend, path: str) -> None:
    reply = await send(guarded.url, path, method="GET")
    assert reply.status == 200


async def test_the_right_key_is_served_and_rejections_are_counted(guarded: Frontend) -> None:
    await send(guarded.url, "/v1/models", method="GET")
    reply = await send(guarded.url, "/v1/chat/completions", chat(), headers=bearer(KEY))
    assert reply.status == 200, reply.raw
    lowercase = {"Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    assert (await send(guarded.url, "/v1/models", method="GET", headers=lowercase)).status == 200
    rejected = metric_value(
        guarded, "dynamo_frontend_rejected_requests_total", model="", reason="unauthorized"
    )
    assert rejected == 1


async def test_the_openai_client_authenticates_with_its_api_key(guarded: Frontend) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0
    ) as client:
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}]
        )
        assert answer.choices[0].message.content
    async with openai.AsyncOpenAI(
        base_url=f"{guarded.url}/v1", api_key="sk-wrong", max_retries=0
    ) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()


async def test_without_a_key_nothing_is_required(frontend: Frontend) -> None:
    reply = await send(frontend.url, "/v1/chat/completions", chat())
    assert reply.status == 200


def test_an_empty_key_is_refused_by_the_check() -> None:
    with pytest.raises(ValueError):
        ApiKeyCheck("")


def test_the_key_comes_from_the_environment_and_stays_out_of_help_and_repr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DYN_API_KEY", KEY)
    config = config_from_args(build_parser().parse_args([]))
    assert config.http.api_key == KEY
    assert KEY not in repr(config)
    assert KEY not in build_parser().format_help()
    flag = config_from_args(build_parser().parse_args(["--api-key", "other"]))
    assert flag.http.api_key == "other", "the flag wins over the variable"
    monkeypatch.setenv("DYN_API_KEY", "")
    assert config_from_args(build_parser().parse_args([])).http.api_key is None
