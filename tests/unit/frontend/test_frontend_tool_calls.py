"""Tool calling in the frontend: the `auto` adapter over vLLM's `hermes` parser on canned
model text (whole and split at awkward points), the `required` / named schemas and
parsers, and the 400s for requests that cannot be served.

Claims:
* the adapter turns Hermes text into OpenAI tool calls (one, two, after text), the same
  whatever the streaming split, and a call is emitted whole, with a `chatcmpl-tool-` id;
* broken JSON inside `<tool_call>` is not a call: the text comes back as content;
* `required` builds an array schema (maxItems 1 without parallel calls) and a named choice
  the function's parameters; both are sent to the worker as structured output;
* bad tools, an unknown named function, `auto` without `--tool-call-parser`, tools with a
  template that cannot render them, and tools combined with `response_format` are 400s
  naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from dynamo.frontend.openai.errors import OpenAIError
from dynamo.frontend.openai.protocol import ChatCompletionRequest
from dynamo.frontend.parsing.chat_output import ChatOutputParser, ChatPieces, merge_tool_calls
from dynamo.frontend.parsing.chat_parsers import ChatParsingOptions, chat_output_parser
from dynamo.frontend.parsing.tool_calls import AutoToolCalls, NamedToolCall, RequiredToolCalls
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.frontend.preprocess.tools import required_schema, tool_request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if tools %}{{ tools | length }} tools\n{% endif %}assistant:"
)
HERMES = ChatParsingOptions(tool_call_parser="hermes")


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def run(parser: ChatOutputParser, chunks: list[str]) -> ChatPieces:
    out = ChatPieces()
    for chunk in chunks:
        out.extend(parser.feed(chunk, []))
    out.extend(parser.finish())
    return out


def split_every(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def auto_parser(tokenizer: Any) -> ChatOutputParser:
    return chat_output_parser(request(tools=[WEATHER, TIME]), HERMES, tokenizer)


def calls(pieces: ChatPieces) -> list[tuple[str, dict[str, Any]]]:
    merged = merge_tool_calls(pieces.tool_calls)
    for call in merged:
        assert call.id.startswith("chatcmpl-tool-")
    return [(c.name, json.loads(c.arguments)) for c in merged]


# ---------------------------------------------------------------------- auto (hermes)

ONE = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TWO = ONE + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_auto_one_call_whatever_the_split(tokenizer: Any, size: int) -> None:
    parser = auto_parser(tokenizer)
    pieces = run(parser, split_every(ONE, size))
    assert calls(pieces) == [("get_weather", {"city": "Paris"})]
    assert pieces.content == ""
    assert parser.made_tool_calls
    # emitted whole: one piece per call
    assert len(pieces.tool_calls) == 1


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_auto_two_calls(tokenizer: Any, size: int) -> None:
    parser = auto_parser(tokenizer)
    pieces = run(parser, split_every(TWO, size))
    assert calls(pieces) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert [p.index for p in pieces.tool_calls] == [0, 1]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_auto_text_before_a_call_is_content(tokenizer: Any, size: int) -> None:
    parser = auto_parser(tokenizer)
    pieces = run(parser, split_every("Let me check. " + ONE, size))
    assert pieces.content == "Let me check. "
    assert calls(pieces) == [("get_weather", {"city": "Paris"})]


def test_auto_first_call_is_streamed_before_the_end(tokenizer: Any) -> None:
    """A call is emitted as soon as its arguments are complete, not only at the end."""
    parser = auto_parser(tokenizer)
    early = ChatPieces()
    for chunk in split_every(ONE, 3):
        early.extend(parser.feed(chunk, []))
    assert calls(early) == [("get_weather", {"city": "Paris"})]
    assert not parser.finish()


def test_auto_a_long_call_is_not_reparsed_on_every_delta(tokenizer: Any) -> None:
    """vLLM's parsers re-parse the whole text on every delta: inside a call the text is
    handed over in growing batches (and whenever a `}` may close it), so a 4,000-character
    argument streamed a character at a time costs dozens of parses, not thousands, and
    the call is still emitted as soon as it is complete."""
    parser = auto_parser(tokenizer)
    assert isinstance(parser, AutoToolCalls)
    vllm_parser = parser.parser
    parsed_chars: list[int] = []
    original = vllm_parser.extract_tool_calls_streaming

    def counting(*args: Any) -> Any:
        parsed_chars.append(len(args[1]))  # current_text: what the parser re-reads
        return original(*args)

    vllm_parser.extract_tool_calls_streaming = counting
    city = "x" * 4000
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "' + city + '"}}</tool_call>'
    early = ChatPieces()
    for chunk in split_every(text, 1):
        early.extend(parser.feed(chunk, []))
    assert calls(early) == [("get_weather", {"city": city})], "emitted before the end"
    assert not parser.finish()
    assert len(parsed_chars) < 200, len(parsed_chars)
    assert sum(parsed_chars) < 20 * len(text), "linear in the text, not quadratic"


@pytest.mark.parametrize("size", [1, 1000])
def test_auto_plain_text_and_a_held_back_marker_are_content(tokenizer: Any, size: int) -> None:
    parser = auto_parser(tokenizer)
    pieces = run(parser, split_every("Paris is sunny <tool", size))
    assert pieces.content == "Paris is sunny <tool"
    assert not pieces.tool_calls and not parser.made_tool_calls


@pytest.mark.parametrize("size", [1, 1000])
def test_auto_broken_json_is_content_not_a_call(tokenizer: Any, size: int) -> None:
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>'
    parser = auto_parser(tokenizer)
    pieces = run(parser, split_every(text, size))
    assert pieces.tool_calls == []
    assert pieces.content == text
    assert not parser.made_tool_calls


# ---------------------------------------------------------------------- required / named


def test_required_schema_is_an_array_of_name_and_parameters() -> None:
    tools = request(tools=[WEATHER, TIME]).tools or []
    schema = required_schema(tools, parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate(good * 2, schema)
    single = required_schema(tools, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good * 2, single)


def test_required_and_named_become_structured_output() -> None:
    req = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    plan = tool_request(req)
    assert plan is not None and plan.constraint is not None
    schema = json.loads(plan.constraint.json_schema or "")
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    named = request(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    plan = tool_request(named)
    assert plan is not None and plan.constraint is not None
    assert json.loads(plan.constraint.json_schema or "") == WEATHER["function"]["parameters"]
    auto = tool_request(request(tools=[WEATHER]))
    assert auto is not None and auto.constraint is None


def test_required_parser_reads_the_array() -> None:
    parser = RequiredToolCalls()
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    pieces = run(parser, split_every(text, 4))
    assert calls(pieces) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert parser.made_tool_calls


def test_required_parser_cut_short_returns_content() -> None:
    parser = RequiredToolCalls()
    pieces = run(parser, ['[{"name": "get_weather", "para'])
    assert pieces.content == '[{"name": "get_weather", "para' and not pieces.tool_calls
    assert not parser.made_tool_calls


def test_named_parser_streams_the_arguments() -> None:
    parser = NamedToolCall("get_weather")
    pieces = run(parser, ['{"city"', ': "Rome"}'])
    assert pieces.tool_calls[0].name == "get_weather" and pieces.tool_calls[0].id
    assert pieces.tool_calls[1].id is None
    assert calls(pieces) == [("get_weather", {"city": "Rome"})]


# ---------------------------------------------------------------------- 400s


def assert_400(fn: Any, param: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn()
    assert info.value.status == 400
    assert info.value.param == param, info.value.body()
    return info.value


def test_a_bad_parameters_schema_is_a_400_naming_it() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    assert_400(lambda: tool_request(request(tools=[WEATHER, bad])), "tools[1].function.parameters")


def test_bad_tool_definitions_are_400s() -> None:
    not_function = {"type": "retrieval", "function": {"name": "f"}}
    assert_400(lambda: tool_request(request(tools=[not_function])), "tools[0].type")
    bad_name = {"type": "function", "function": {"name": "has space"}}
    assert_400(lambda: tool_request(request(tools=[bad_name])), "tools[0].function.name")
    assert_400(lambda: tool_request(request(tools=[WEATHER, WEATHER])), "tools[1].function.name")
    assert_400(lambda: tool_request(request(tool_choice="required")), "tool_choice")


def test_a_named_function_not_in_tools_is_a_400() -> None:
    choice = {"type": "function", "function": {"name": "launch"}}
    assert_400(lambda: tool_request(request(tools=[WEATHER], tool_choice=choice)), "tool_choice")


def test_auto_without_a_parser_is_a_400_saying_how(tokenizer: Any) -> None:
    error = assert_400(
        lambda: chat_output_parser(request(tools=[WEATHER]), ChatParsingOptions(), tokenizer),
        "tool_choice",
    )
    assert "--tool-call-parser" in error.message
    # required / named / none need no parser
    for choice in ("required", "none", {"type": "function", "function": {"name": "get_weather"}}):
        chat_output_parser(
            request(tools=[WEATHER], tool_choice=choice), ChatParsingOptions(), tokenizer
        )


def test_tools_with_a_template_without_tools_are_a_400(tokenizer: Any, card: Any) -> None:
    pre = Preprocessor(card, tokenizer)
    req = request(tools=[WEATHER], tool_choice="required")
    error = assert_400(lambda: pre.prepare_chat_sync(req, "r"), "tools")
    assert "--chat-template" in error.message


def test_chat_template_override_renders_tools_and_history(tokenizer: Any, card: Any) -> None:
    own_template = tokenizer.chat_template
    pre = Preprocessor(card, tokenizer, chat_template=TOOLS_TEMPLATE)
    assert tokenizer.chat_template == own_template, "the caller's tokenizer is untouched"
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    req = request(messages=history, tools=[WEATHER, TIME], tool_choice="required")
    prepared = pre.prepare_chat_sync(req, "r")
    assert prepared.request.structured_output is not None
    assert "2 tools" in pre.render_chat(req)
    assert "tool: sunny" in pre.render_chat(req)


def test_tool_choice_with_response_format_is_a_400(tokenizer: Any, card: Any) -> None:
    pre = Preprocessor(card, tokenizer, chat_template=TOOLS_TEMPLATE)
    req = request(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert_400(lambda: pre.prepare_chat_sync(req, "r"), "tool_choice")


@pytest.fixture
def card() -> Any:
    from frontend_support import make_card

    return make_card()


# ---------------------------------------------------------------------- start-up flags


def test_a_missing_or_broken_chat_template_stops_the_frontend(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from dynamo.frontend.__main__ import main

    assert main(["--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "missing.jinja" in capsys.readouterr().err
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m }}")
    assert main(["--chat-template", str(broken)]) == 2
    assert "not a valid Jinja template" in capsys.readouterr().err


def test_the_shipped_template_loads(tmp_path: Any) -> None:
    from pathlib import Path

    from dynamo.frontend.preprocess.chat_template_file import load_chat_template
    from dynamo.frontend.preprocess.tools import template_reads_tools

    shipped = Path(__file__).parents[3] / "examples" / "chat_templates" / "smollm2_tools.jinja"
    assert template_reads_tools(load_chat_template(shipped))


def test_an_unknown_tool_call_parser_stops_the_frontend_listing_the_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dynamo.frontend.__main__ import main

    assert main(["--tool-call-parser", "no-such-parser"]) == 2
    err = capsys.readouterr().err
    assert "no-such-parser" in err and "hermes" in err
