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
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from dynamo.frontend.routing import RouterMode
from dynamo.llm.worker import ServedWorker
from dynamo.mocker.args import WorkerSettings
from dynamo.mocker.backend import MockerBackend, mocker_worker
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.model_info import ModelInfo
from dynamo.mocker.timing import TimingModel
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.http import wait_for_instances_async

MODEL = "mock-structured"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
MESSAGES: Any = [{"role": "user", "content": "Who are you?"}]


@pytest_asyncio.fixture(scope="module")
async def served(
    nats_url: str, embedded_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, ServedWorker[MockerBackend]]]:
    namespace = "so" + uuid.uuid4().hex[:8]
    info = ModelInfo.load(embedded_model)
    engine_config = MockEngineConfig(
        block_size=16,
        num_gpu_blocks=256,
        max_model_len=2048,
        timing=TimingModel(speed_up=1000.0),
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        special_token_ids=info.special_token_ids,
    )
    settings = WorkerSettings(namespace=namespace, nats_server=nats_url, lease_ttl=10.0)
    worker = mocker_worker(
        settings, engine_config, model_path=embedded_model, served_model_name=MODEL, name="m0"
    )
    frontend = InLoopFrontend.start(
        nats_url, namespace, tmp_path_factory.mktemp("tok"), router_mode=RouterMode.ROUND_ROBIN
    )
    try:
        await worker.start()
        await wait_for_instances_async(frontend.base_url, MODEL, 1, timeout=60, interval=0.05)
        yield frontend.base_url, worker
    finally:
        await frontend.stop()
        await worker.stop(drain_timeout=1.0)


@pytest_asyncio.fixture
async def client(served: tuple[str, Any]) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


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
    with pytest.raises(openai.BadRequestError) as info:
        result = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, stream=stream, **CONSTRAINTS[kind]
        )
        if stream:
            async for _ in result:  # type: ignore[union-attr]
                pass
    assert "not supported by the mocker" in str(info.value)


async def test_invalid_schema_is_refused_before_the_worker(
    client: openai.AsyncOpenAI, served: tuple[str, ServedWorker[MockerBackend]]
) -> None:
    engine = served[1].backend.engine
    before = engine.counters.requests
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object", "required": "name"}},
            },
        )
    assert "not a valid JSON schema" in str(info.value)
    assert engine.counters.requests == before


async def test_unconstrained_requests_are_served(client: openai.AsyncOpenAI) -> None:
    results = await asyncio.gather(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4),
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, response_format={"type": "text"}
        ),
    )
    for result in results:
        assert result.choices[0].finish_reason in ("length", "stop")
