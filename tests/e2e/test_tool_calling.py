"""Tool calling with the real embedded model behind the frontend, through the official
`openai` client.

Claims:
* `tool_choice="required"` and a named function return tool calls whose arguments
  validate against the tool's schema, streaming and not, with `finish_reason`
  `tool_calls` (structured output enforces the schema);
* `auto` with the shipped template (`examples/chat_templates/smollm2_tools.jinja`) and
  `--tool-call-parser hermes` runs end to end: the 135M model does not call a tool from
  the tools section alone under greedy decoding (it answers in prose), but with two
  earlier calls in the conversation (rendered by the template) it answers with a Hermes
  call, which comes back as an OpenAI tool call, streaming and not.

Uses the session's shared workers (`conftest.py`) with its own frontend (flags).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.processes import FrontendProcess, WorkerProcess

MODEL = DEFAULT_MODEL
TEMPLATE = Path(__file__).parents[2] / "examples" / "chat_templates" / "smollm2_tools.jinja"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# A conversation whose earlier turn shows the model a call in the template's format (the
# 135M model does not call a tool from the tools section alone under greedy decoding).
def _call_turn(city: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city, "unit": "celsius"})
    call = {"id": f"call-{city}", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


FEW_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    _call_turn("London"),
    {"role": "user", "content": "What is the weather in Berlin?"},
    _call_turn("Berlin"),
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def tools_frontend(
    plain_worker: WorkerProcess, nats_url: str, e2e_log_dir: Path
) -> Iterator[FrontendProcess]:
    proc = FrontendProcess(
        "frontend-tools",
        nats_url,
        e2e_log_dir,
        namespace=plain_worker.namespace,
        extra=["--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes"],
    )
    try:
        proc.wait_for_model(MODEL, timeout=120)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(tools_frontend: FrontendProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{tools_frontend.base_url}/v1", api_key="unused", max_retries=0
    )


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def create(client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", MESSAGES)
    return await client.chat.completions.create(
        model=MODEL, tools=TOOLS, temperature=0, max_tokens=120, **kwargs
    )


async def collect_stream(client: openai.AsyncOpenAI, **kwargs: object) -> tuple[dict, str | None]:
    stream = await create(client, stream=True, **kwargs)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = call["id"] or (piece.id or "")
                if piece.function is not None:
                    call["name"] = call["name"] or (piece.function.name or "")
                    call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
async def test_required_and_named_return_valid_calls(
    client: openai.AsyncOpenAI, choice: object
) -> None:
    result = await create(client, tool_choice=choice)
    message = result.choices[0].message
    assert result.choices[0].finish_reason == "tool_calls", message
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-")
        check_call(call.function.name, call.function.arguments)
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]

    calls, finish = await collect_stream(client, tool_choice=choice)
    assert finish == "tool_calls"
    assert calls
    for call in calls.values():
        assert call["id"].startswith("chatcmpl-tool-")
        check_call(call["name"], call["arguments"])


async def test_required_without_parallel_calls_makes_one_call(client: openai.AsyncOpenAI) -> None:
    result = await create(client, tool_choice="required", parallel_tool_calls=False)
    assert len(result.choices[0].message.tool_calls or []) == 1


async def test_auto_with_the_hermes_parser_end_to_end(client: openai.AsyncOpenAI) -> None:
    """With two earlier calls in the history, the model answers the third question with
    a Hermes call under greedy decoding (without them it answers in prose); the `hermes`
    parser turns it into an OpenAI tool call, streaming and not."""
    result = await create(client, messages=FEW_SHOT)
    choice = result.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls", choice.message
    assert [c.function.name for c in calls] == ["get_weather"]
    check_call(calls[0].function.name, calls[0].function.arguments)
    assert json.loads(calls[0].function.arguments)["city"] == "Paris"
    assert not choice.message.content

    streamed, finish = await collect_stream(client, messages=FEW_SHOT)
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]


async def test_tools_are_refused_by_a_frontend_without_a_tools_template(
    frontend: FrontendProcess,
) -> None:
    plain = openai.AsyncOpenAI(base_url=f"{frontend.base_url}/v1", api_key="u", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        await plain.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=5
        )
    assert "--chat-template" in str(info.value)
