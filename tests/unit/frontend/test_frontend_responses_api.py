"""`/v1/responses` as a thin layer over chat completions (`responses_api.py`), unit level.

Claims:
* a Responses request becomes the chat request it means: `instructions` a first system
  message, `developer` a system message, text parts joined as the chat path joins them,
  `max_output_tokens` the completion bound, and `text.format` `json_schema` /
  `json_object` chat's `response_format`, so the structured-output module turns it into
  the worker's constraint (the mocker refuses structured output, so the integration
  test can only see that it reached the worker; the constraint itself is checked here);
* errors of the chat path name the Responses fields (`text.format.schema`,
  `max_output_tokens`, `input`);
* the formatter's `response.failed` (an engine failure in the stream) and its events are
  valid for the official client's types.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import msgspec
import pydantic
import pytest
from frontend_support import MODEL, Frontend, output_plan
from http_support import assert_openai_error, send
from openai.types.responses import Response, ResponseStreamEvent

from dynamo.frontend.http import server as http_server
from dynamo.frontend.openai import limits
from dynamo.frontend.openai.errors import OpenAIError, bad_request, engine_error
from dynamo.frontend.openai.protocol import Usage
from dynamo.frontend.openai.responses_protocol import ResponsesRequest
from dynamo.frontend.postprocess.postprocessor import TextDelta
from dynamo.frontend.postprocess.responses_api import (
    ResponsesFormatter,
    to_chat_request,
    translated,
)
from dynamo.frontend.preprocess.structured_output import structured_output_of

DECODER = msgspec.json.Decoder(ResponsesRequest)
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
PLAN = output_plan(stream=True, include_usage=True)
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def convert(**body: Any) -> Any:
    return to_chat_request(DECODER.decode(msgspec.json.encode({"model": "m", **body})))


def test_the_request_becomes_the_chat_request_it_means() -> None:
    chat = convert(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "One word."},
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
        ],
        max_output_tokens=7,
        temperature=0.3,
        top_p=0.9,
        stream=True,
        store=True,
        metadata={"k": "v"},
    )  # fmt: skip
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."),
        ("system", "One word."),
        ("user", "a\nb"),
        ("assistant", "c"),
    ]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (7, 0.3, 0.9)
    assert chat.stream and chat.stream_options.include_usage  # response.completed has usage
    assert chat.response_format is None and chat.metadata == {"k": "v"}


def test_a_string_input_is_one_user_message() -> None:
    chat = convert(input="Hello")
    assert [(m.role, m.content) for m in chat.messages] == [("user", "Hello")]
    assert not chat.stream and chat.stream_options is None


def test_json_schema_format_becomes_the_workers_constraint() -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    chat = convert(input="x", text={"format": fmt})
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == PERSON
    assert chat.response_format.json_schema.strict is True
    constraint = structured_output_of(chat)
    assert constraint is not None and msgspec.json.decode(constraint.json_schema) == PERSON


def test_json_object_and_text_formats() -> None:
    json_object = structured_output_of(convert(input="x", text={"format": {"type": "json_object"}}))
    assert json_object is not None and json_object.json_object
    assert convert(input="x", text={"format": {"type": "text"}}).response_format is None


@pytest.mark.parametrize(
    ("fmt", "named"),
    [
        ({"type": "json_schema", "schema": PERSON}, "`text.format.name`"),
        ({"type": "json_schema", "name": "p"}, "`text.format.schema`"),
        ({"type": "grammar"}, "`text.format.type`"),
    ],
)
def test_bad_formats_are_refused_naming_the_field(fmt: dict[str, Any], named: str) -> None:
    with pytest.raises(OpenAIError) as info:
        convert(input="x", text={"format": fmt})
    assert info.value.status == 400 and info.value.param == "text.format"
    assert named in info.value.message


def test_an_empty_input_list_is_refused() -> None:
    with pytest.raises(OpenAIError) as info:
        convert(input=[])
    assert info.value.param == "input"


@pytest.mark.parametrize(
    ("chat_error", "param", "text"),
    [
        (
            bad_request("`response_format.json_schema.schema` is not valid", "response_format"),
            "text.format",
            "`text.format.schema` is not valid",
        ),
        (bad_request("`max_completion_tokens` is too big", "max_completion_tokens"),
         "max_output_tokens", "`max_output_tokens` is too big"),
        (bad_request("`messages` must not be empty", "messages"), "input", "`input` must"),
    ],
)  # fmt: skip
def test_chat_errors_name_the_responses_fields(
    chat_error: OpenAIError, param: str, text: str
) -> None:
    renamed = translated(chat_error)
    assert (renamed.status, renamed.param) == (400, param)
    assert renamed.message.startswith(text)


def _events(payload: bytes) -> list[dict[str, Any]]:
    """The JSON data of each SSE event, checking that `event:` names its type."""
    out = []
    for block in payload.decode().split("\n\n"):
        if not block:
            continue
        event_line, data_line = block.split("\n")
        data = msgspec.json.decode(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        out.append(data)
    return out


def test_an_engine_failure_mid_stream_ends_with_response_failed() -> None:
    """The stream loop (generation.py) reports a failure, in a delta or between batches,
    through `failure_event`, then writes `end_of_stream`: for the Responses API that is
    `response.failed` as the last event and no `data: [DONE]` line."""
    formatter = ResponsesFormatter("resp-abc", "m", PLAN)
    events = _events(formatter.events(TextDelta(text="Hel", token_count=1)))
    events += _events(formatter.events(TextDelta(text="lo", token_count=1, error="worker died")))
    events += _events(formatter.failure_event(engine_error("worker died")))
    assert formatter.end_of_stream() == b""
    for event in events:
        STREAM_EVENT.validate_python(event)
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "worker died"
    assert failed["output"][0]["content"][0]["text"] == "Hello"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_unary_body_is_a_valid_response_object() -> None:
    formatter = ResponsesFormatter("resp-abc", "m", PLAN)
    formatter.add(TextDelta(text="Hi", token_count=1))
    formatter.add(TextDelta(text="", token_count=1, finish_reason="length"))
    usage = Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7)
    response = Response.model_validate_json(formatter.body(usage))
    assert response.id == "resp_abc" and response.output_text == "Hi"
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.total_tokens == 7


# ---------------------------------------------------------------------- input arrays


async def test_an_input_array_over_the_message_bound_is_400(frontend: Frontend) -> None:
    items = [{"role": "user", "content": "x"}] * (limits.MAX_MESSAGES + 1)
    reply = await send(frontend.url, "/v1/responses", {"model": MODEL, "input": items})
    error = assert_openai_error(reply, 400, param="input")
    assert f"at most {limits.MAX_MESSAGES}" in error["message"]
    assert frontend.client.requests == []


async def test_the_input_array_is_converted_off_the_event_loop_after_admission(
    frontend: Frontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion runs once the request holds its admission place, in a thread: while
    it is held, the event loop serves `/live`."""
    gate, started, released = threading.Event(), threading.Event(), []
    original = http_server.RESPONSES.convert
    assert original is not None

    def blocking(req: Any) -> Any:
        started.set()
        released.append(gate.wait(10))
        return original(req)

    monkeypatch.setattr(
        http_server, "RESPONSES", dataclasses.replace(http_server.RESPONSES, convert=blocking)
    )
    body = {"model": MODEL, "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 4}
    pending = asyncio.create_task(send(frontend.url, "/v1/responses", body))
    try:
        await asyncio.wait_for(asyncio.to_thread(started.wait, 10), 15)
        live = await asyncio.wait_for(send(frontend.url, "/live", method="GET"), 5)
        assert live.status == 200
    finally:
        gate.set()
    reply = await pending
    assert reply.status == 200, reply.raw
    assert released == [True], "the conversion was held until the test released it"
