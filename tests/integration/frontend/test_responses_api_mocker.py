"""`POST /v1/responses` through the real frontend (in this process) and a mocker worker
over a real nats-server, with the official `openai` client.

Claims:
* a non-streaming response is the `response` object the client's own types accept
  (validated strictly with the SDK's pydantic models, not just constructed): non-empty
  `output_text`, usage that sums, `status` `completed`; `max_output_tokens` cutting it
  makes it `incomplete` with `incomplete_details.reason` `max_output_tokens`;
* streaming gives the typed events in OpenAI's order with increasing
  `sequence_number`s, every one valid for the SDK's event union; the deltas concatenate
  to the final text;
* a message list (system, developer, assistant history, `input_text` parts) is served;
  `store: true`, `metadata` and `user` are accepted;
* every field that needs stored state or a feature we do not serve here is a 400 whose
  `param` and message name it, and never reaches the worker;
* `text.format` `json_schema` reaches the worker as a structured-output constraint: the
  mocker, which cannot honour one, refuses it with its own 400; an invalid schema is
  refused by the frontend, naming `text.format.schema`.

The mocker's tokens are drawn from a PRNG seeded by the prompt, so each prompt below
gives the same text (and the same EOS) on every run.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from dynamo.llm.worker import ServedWorker
from dynamo.mocker.backend import MockerBackend
from dynamo.testing.mocker_clusters import (
    bad_request_of,
    openai_client_fixture,
    refused_before_the_worker,
    served_mocker_fixture,
)

MODEL = "mock-responses"
PROMPT = "Name three colours."
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]

# Responses end on their own (`completed`) within ~10 tokens.
served = served_mocker_fixture(MODEL, eos_probability=0.1)
client = openai_client_fixture()


async def create_validated(client: openai.AsyncOpenAI, **kwargs: Any) -> Response:
    """`responses.create`, with the body validated strictly by the SDK's model (the
    client itself only constructs it, which would let a missing field through)."""
    raw = await client.responses.with_raw_response.create(model=MODEL, **kwargs)
    return Response.model_validate_json(raw.content)


async def stream_validated(client: openai.AsyncOpenAI, **kwargs: Any) -> list[Any]:
    """Every event of a streamed response, each validated strictly."""
    stream = await client.responses.create(model=MODEL, stream=True, **kwargs)
    return [STREAM_EVENT.validate_python(event.model_dump()) async for event in stream]


def check_usage(response: Response) -> None:
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


async def test_a_response_is_the_object_the_official_client_reads(
    client: openai.AsyncOpenAI,
) -> None:
    response = await create_validated(
        client, input=PROMPT, instructions="Be brief.", max_output_tokens=200, temperature=0.5
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text  # the SDK's convenience, from output[0].content[0].text
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.instructions == "Be brief." and response.temperature == 0.5
    check_usage(response)
    # The plain client call parses the same body.
    again = await client.responses.create(model=MODEL, input=PROMPT, instructions="Be brief.")
    assert again.output_text == response.output_text


async def test_max_output_tokens_makes_the_response_incomplete(
    client: openai.AsyncOpenAI,
) -> None:
    response = await create_validated(client, input=PROMPT, max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 2
    events = await stream_validated(client, input=PROMPT, max_output_tokens=2)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


async def test_streaming_sends_the_typed_events_in_order(client: openai.AsyncOpenAI) -> None:
    events = await stream_validated(client, input=PROMPT, max_output_tokens=200)
    types = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert deltas, types
    assert types == OPENING + ["response.output_text.delta"] * len(deltas) + CLOSING + [
        "response.completed"
    ]
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    text = "".join(event.delta for event in deltas)
    final = events[-1].response
    assert text and events[len(OPENING) + len(deltas)].text == text
    assert final.output_text == text and final.status == "completed"
    check_usage(final)
    # The same prompt without streaming gives the same text (the mocker is seeded by it).
    unary = await create_validated(client, input=PROMPT, max_output_tokens=200)
    assert unary.output_text == text


async def test_a_stream_ends_with_its_last_typed_event_and_no_done_line(
    served: tuple[str, Any],
) -> None:
    """OpenAI's Responses stream has no `data: [DONE]` line (the chat stream does): a
    client that decodes every event's data as JSON must not meet one."""
    body = {"model": MODEL, "input": PROMPT, "stream": True, "max_output_tokens": 20}
    async with aiohttp.ClientSession() as session:
        async with session.post(served[0] + "/v1/responses", json=body) as resp:
            assert resp.status == 200
            raw = (await resp.read()).decode()
    blocks = [block for block in raw.split("\n\n") if block.strip()]
    assert "[DONE]" not in raw
    assert blocks[-1].startswith("event: response.")
    assert blocks[-1].split("\n")[0] in ("event: response.completed", "event: response.incomplete")


async def test_a_message_list_with_history_is_served(client: openai.AsyncOpenAI) -> None:
    response = await create_validated(
        client,
        input=[
            {"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
            },
            {"role": "user", "content": "Colour of the sky?"},
        ],
        store=True,  # the API's default: accepted, nothing is stored
        metadata={"job": "test"},
        user="someone",
        max_output_tokens=200,
    )
    assert response.output_text and response.metadata == {"job": "test"}


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
]


@pytest.mark.parametrize(("fields", "name"), REFUSED, ids=[name for _, name in REFUSED])
async def test_fields_we_do_not_serve_are_refused_naming_them(
    client: openai.AsyncOpenAI,
    served: tuple[str, ServedWorker[MockerBackend]],
    fields: dict[str, Any],
    name: str,
) -> None:
    engine = served[1].backend.engine
    before = engine.counters.requests
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input=PROMPT, **fields)
    assert info.value.param == name
    assert f"`{name}`" in info.value.message
    assert engine.counters.requests == before


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ({"type": "function_call_output", "call_id": "c1", "output": "42"}, "input[0].type"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]},
            "input[0].content[0].type",
        ),
    ],
)
async def test_input_items_we_do_not_serve_are_refused_naming_them(
    client: openai.AsyncOpenAI, item: dict[str, Any], named: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input=[item])
    assert info.value.param == "input"
    assert f"`{named}`" in info.value.message


@pytest.mark.parametrize("stream", [False, True])
async def test_a_json_schema_format_reaches_the_worker_as_a_constraint(
    client: openai.AsyncOpenAI, stream: bool
) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    error = await bad_request_of(
        client.responses.create(model=MODEL, input=PROMPT, text={"format": fmt}, stream=stream),
        stream=stream,
    )
    assert "not supported by the mocker" in str(error)


async def test_an_invalid_schema_is_refused_naming_text_format(
    client: openai.AsyncOpenAI, served: tuple[str, ServedWorker[MockerBackend]]
) -> None:
    bad = {"type": "json_schema", "name": "p", "schema": {"type": "object", "required": "name"}}
    error = await refused_before_the_worker(
        served, client.responses.create(model=MODEL, input=PROMPT, text={"format": bad})
    )
    assert error.param == "text.format"
    assert "`text.format.schema` is not a valid JSON schema" in error.message
