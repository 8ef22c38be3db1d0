"""Structured output behind a real frontend over a real nats-server, served by a mocker.

The mocker samples random tokens: it cannot honour a JSON schema, a regex or a choice.

Claims:
* a request with `response_format` / `structured_outputs` / `guided_*` that reaches a
  mocker worker is refused there as the client's error: HTTP 400 through the official
  `openai` client, saying structured output is not supported by the mocker, streaming
  or not (never a 200 with text that ignores the constraint);
* an invalid JSON schema is refused by the frontend itself (400 naming the problem)
  without the worker's engine being handed the request;
* the same request without a constraint is served normally.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from dynamo.llm.worker import ServedWorker
from dynamo.mocker.backend import MockerBackend
from dynamo.testing.mocker_clusters import (
    bad_request_of,
    openai_client_fixture,
    refused_before_the_worker,
    served_mocker_fixture,
)

MODEL = "mock-structured"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
MESSAGES: Any = [{"role": "user", "content": "Who are you?"}]

served = served_mocker_fixture(MODEL)
client = openai_client_fixture()


CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    },
    "json_object": {"response_format": {"type": "json_object"}},
    "structured_outputs": {"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}},
    "guided_regex": {"extra_body": {"guided_regex": "[0-9]+"}},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
async def test_the_mocker_refuses_structured_output_with_a_400(
    client: openai.AsyncOpenAI, kind: str, stream: bool
) -> None:
    error = await bad_request_of(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, stream=stream, **CONSTRAINTS[kind]
        ),
        stream=stream,
    )
    assert "not supported by the mocker" in str(error)


async def test_invalid_schema_is_refused_before_the_worker(
    client: openai.AsyncOpenAI, served: tuple[str, ServedWorker[MockerBackend]]
) -> None:
    error = await refused_before_the_worker(
        served,
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object", "required": "name"}},
            },
        ),
    )
    assert "not a valid JSON schema" in str(error)


async def test_unconstrained_requests_are_served(client: openai.AsyncOpenAI) -> None:
    results = await asyncio.gather(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4),
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, response_format={"type": "text"}
        ),
    )
    for result in results:
        assert result.choices[0].finish_reason in ("length", "stop")
