"""Structured output at the frontend (`dynamo.frontend.preprocess.structured_output`).

Claims:
* `response_format` (`json_object`, `json_schema` with `strict`), vLLM's
  `structured_outputs` and the older `guided_*` fields each become one `StructuredOutput`
  on the request the worker receives; `text` and no field at all leave it unconstrained;
* whitespace options of `structured_outputs` (or `guided_whitespace_pattern`) ride along,
  also next to a `response_format`;
* a broken schema, a malformed constraint, two constraints at once, or an unsupported
  `response_format.type` are a 400 naming the field, decided before any worker is
  touched (the scripted engine sees no request);
* through the official `openai` client, `response_format` and `extra_body` reach the
  worker as sent;
* a `$schema` that is not a string is a 400 on every path a schema takes (it was a 500);
* what a constraint may cost is bounded (schema size and depth, regex, grammar, choices),
  and schemas are checked in a pool of their own: while schema checks block, `/live`
  answers and a chat request without a schema is templated and served.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import openai
import pytest
from frontend_support import MODEL, Frontend, chat_request, completion_request, openai_error_of
from http_support import assert_openai_error, chat, completion, send

from dynamo.frontend.openai.errors import from_validation_error
from dynamo.frontend.openai.protocol import ChatCompletionRequest
from dynamo.frontend.preprocess import structured_output
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.frontend.preprocess.structured_output import structured_output_of
from dynamo.llm.protocols import StructuredOutput
from dynamo.testing.waiting import wait_until_async

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def json_schema_format(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **extra}}


def constraint_of(**fields: Any) -> StructuredOutput | None:
    return structured_output_of(chat_request(**fields))


def assert_constraint_refused(fields: dict[str, Any], param: str, words: str) -> None:
    """The request's constraint `fields` are refused with a 400 naming `param`, its message
    saying `words`."""
    err = openai_error_of(lambda: constraint_of(**fields))
    assert (err.status, err.param) == (400, param)
    assert words in err.message


# ---------------------------------------------------------------------- accepted spellings


def test_no_field_and_text_format_are_unconstrained() -> None:
    assert constraint_of() is None
    assert constraint_of(response_format={"type": "text"}) is None


def test_json_object_and_json_schema_with_strict() -> None:
    assert constraint_of(response_format={"type": "json_object"}) == StructuredOutput(
        json_object=True
    )
    for strict in (True, False, None):
        got = constraint_of(response_format=json_schema_format(PERSON, strict=strict))
        assert got is not None and json.loads(got.json_schema or "") == PERSON


@pytest.mark.parametrize(
    ("so", "expected"),
    [
        ({"json": PERSON}, StructuredOutput(json_schema=json.dumps(PERSON, separators=(",", ":")))),
        (
            {"json": json.dumps(PERSON)},
            StructuredOutput(json_schema=json.dumps(PERSON, separators=(",", ":"))),
        ),
        ({"regex": r"\d{3}"}, StructuredOutput(regex=r"\d{3}")),
        ({"choice": ["yes", "no"]}, StructuredOutput(choice=["yes", "no"])),
        ({"grammar": 'root ::= "a"'}, StructuredOutput(grammar='root ::= "a"')),
        ({"json_object": True}, StructuredOutput(json_object=True)),
        ({"structural_tag": '{"type": "x"}'}, StructuredOutput(structural_tag='{"type": "x"}')),
    ],
)
def test_structured_outputs_extension(so: dict[str, Any], expected: StructuredOutput) -> None:
    assert constraint_of(structured_outputs=so) == expected


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        (
            "guided_json",
            PERSON,
            StructuredOutput(json_schema=json.dumps(PERSON, separators=(",", ":"))),
        ),
        ("guided_regex", "[ab]+", StructuredOutput(regex="[ab]+")),
        ("guided_choice", ["red", "blue"], StructuredOutput(choice=["red", "blue"])),
        ("guided_grammar", 'root ::= "x"', StructuredOutput(grammar='root ::= "x"')),
    ],
)
def test_older_guided_fields_are_honoured(
    field: str, value: Any, expected: StructuredOutput
) -> None:
    assert constraint_of(**{field: value}) == expected


def test_whitespace_options_ride_along() -> None:
    got = constraint_of(
        response_format=json_schema_format(PERSON),
        structured_outputs={"disable_any_whitespace": True, "whitespace_pattern": " ?"},
    )
    assert got is not None and got.json_schema is not None
    assert got.disable_any_whitespace and got.whitespace_pattern == " ?"
    got = constraint_of(guided_json=PERSON, guided_whitespace_pattern="[ ]")
    assert got is not None and got.whitespace_pattern == "[ ]"


def test_completions_carry_it_too(preprocessor: Preprocessor) -> None:
    req = completion_request(response_format={"type": "json_object"})
    prepared = preprocessor.prepare_completion_sync(req, "r")
    assert prepared.request.structured_output == StructuredOutput(json_object=True)
    chat = preprocessor.prepare_chat_sync(chat_request(guided_choice=["a", "b"]), "r")
    assert chat.request.structured_output == StructuredOutput(choice=["a", "b"])
    assert preprocessor.prepare_chat_sync(chat_request(), "r").request.structured_output is None


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"response_format": json_schema_format({"type": "objekt"})},
            "response_format",
            "not a valid JSON schema",
        ),
        (
            {"response_format": json_schema_format({"properties": {"a": {"minLength": -1}}})},
            "response_format",
            "properties/a/minLength",
        ),
        ({"response_format": json_schema_format(None)}, "response_format", "schema` is required"),
        ({"response_format": json_schema_format([1, 2])}, "response_format", "JSON schema object"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "is required"),
        ({"response_format": {"type": "yaml"}}, "response_format", "`yaml` is not supported"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
        ({"structured_outputs": {"json": "  "}}, "structured_outputs", "must not be empty"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "only one constraint",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one choice"),
        ({"structured_outputs": {"grammar": " "}}, "structured_outputs", "must not be empty"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "must be true"),
        ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs", "NUL"),
        (
            {"structured_outputs": {"disable_any_whitespace": True}},
            "structured_outputs",
            "must set one of",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "send only one",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "send only one",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "Only one of"),
        ({"guided_json": {"type": 5}}, "guided_json", "not a valid JSON schema"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    assert_constraint_refused(fields, param, words)


def test_wrongly_typed_fields_are_400_at_decoding() -> None:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [],
            "response_format": {"type": "json_schema", "json_schema": {}},
        }
    )
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(body, type=ChatCompletionRequest)
    err = from_validation_error(info.value)
    assert err.status == 400 and "response_format" in (err.param or err.message)


# ---------------------------------------------------------------------- through HTTP


async def test_openai_client_fields_reach_the_worker(
    client: openai.AsyncOpenAI, frontend: Frontend
) -> None:
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    sent = frontend.client.requests[-1].structured_output
    assert sent is not None and json.loads(sent.json_schema or "") == PERSON
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Yes or no?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert frontend.client.requests[-1].structured_output == StructuredOutput(choice=["yes", "no"])


async def test_invalid_schema_is_400_before_any_worker(
    client: openai.AsyncOpenAI, frontend: Frontend
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Who?"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": {"type": "objekt"}},
            },
        )
    assert "not a valid JSON schema" in str(info.value)
    assert "objekt" in str(info.value)
    assert frontend.client.requests == []


# ---------------------------------------------------------------------- hostile schemas


@pytest.mark.parametrize("meta", [[], {}, 5], ids=["list", "object", "number"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (lambda schema: {"response_format": json_schema_format(schema)}, "response_format"),
        (lambda schema: {"guided_json": schema}, "guided_json"),
        (lambda schema: {"structured_outputs": {"json": schema}}, "structured_outputs"),
        (
            lambda schema: {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]
            },
            "tools[0].function.parameters",
        ),
    ],
    ids=["response_format", "guided_json", "structured_outputs", "tool_parameters"],
)
def test_a_schema_naming_a_non_string_meta_schema_is_400(
    preprocessor: Preprocessor, fields: Any, param: str, meta: Any
) -> None:
    schema = {"$schema": meta, "type": "object"}
    err = openai_error_of(
        lambda: preprocessor.prepare_chat_sync(chat_request(**fields(schema)), "r")
    )
    assert (err.status, err.param) == (400, param)
    assert "$schema` must be a string" in err.message


async def test_a_responses_text_format_with_a_non_string_meta_schema_is_400(
    frontend: Frontend,
) -> None:
    body = {
        "model": MODEL,
        "input": "Who?",
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"$schema": []}}},
    }
    reply = await send(frontend.url, "/v1/responses", body)
    error = assert_openai_error(reply, 400)
    assert "$schema" in error["message"]
    assert frontend.client.requests == []


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {
                "guided_json": {
                    "type": "object",
                    "properties": {
                        f"p{i}": {"type": "string"}
                        for i in range(structured_output.MAX_SCHEMA_CHARS // 20)
                    },
                }
            },
            "guided_json",
            f"at most {structured_output.MAX_SCHEMA_CHARS}",
        ),
        (
            {
                "response_format": json_schema_format(
                    nested_schema(structured_output.MAX_SCHEMA_DEPTH)
                )
            },
            "response_format",
            f"more than {structured_output.MAX_SCHEMA_DEPTH} levels",
        ),
        (
            {"guided_choice": ["x" * 1000] * (structured_output.MAX_CONSTRAINT_CHARS // 1000 + 1)},
            "guided_choice",
            f"at most {structured_output.MAX_CONSTRAINT_CHARS}",
        ),
        (
            {"structured_outputs": {"regex": "a" * (structured_output.MAX_CONSTRAINT_CHARS + 1)}},
            "structured_outputs",
            f"at most {structured_output.MAX_CONSTRAINT_CHARS}",
        ),
        (
            {"guided_grammar": "x" * (structured_output.MAX_CONSTRAINT_CHARS + 1)},
            "guided_grammar",
            f"at most {structured_output.MAX_CONSTRAINT_CHARS}",
        ),
    ],
    ids=["schema_size", "schema_depth", "choices", "regex", "grammar"],
)
def test_constraints_beyond_their_bounds_are_400(
    fields: dict[str, Any], param: str, words: str
) -> None:
    assert_constraint_refused(fields, param, words)


def test_a_schema_just_inside_the_depth_bound_is_served() -> None:
    # nested_schema(d) nests d arrays around a string: d + 1 levels of objects
    depth = structured_output.MAX_SCHEMA_DEPTH - 1
    got = constraint_of(guided_json=nested_schema(depth))
    assert got is not None and json.loads(got.json_schema or "") == nested_schema(depth)


GATE_TIMEOUT_S = 10.0
"""How long a blocked schema check waits for the test to release it."""


@pytest.fixture
def blocked_schema_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, list[str], list[bool]]]:
    """Every schema check blocks until the returned gate is set; the names of the threads
    the checks ran on are recorded, and whether the test released each (False: the wait
    timed out)."""
    gate, threads, released = threading.Event(), [], []
    original = structured_output.jsonschema.validators.validator_for

    def blocking(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        released.append(gate.wait(GATE_TIMEOUT_S))
        return original(*args, **kwargs)

    monkeypatch.setattr(structured_output.jsonschema.validators, "validator_for", blocking)
    try:
        yield gate, threads, released
    finally:
        gate.set()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_schemas_are_checked_off_the_loop_and_off_the_template_pool(
    frontend: Frontend,
    blocked_schema_checks: tuple[threading.Event, list[str], list[bool]],
    path: str,
) -> None:
    """More schema requests than every pool has threads are held in their check; the
    event loop still answers `/live`, and a chat request without a schema (rendered in
    the templates' pool) is served meanwhile."""
    gate, threads, released = blocked_schema_checks
    body = completion if path == "/v1/completions" else chat
    held = 12  # more than asyncio's default pool on any machine with up to 8 cores
    pending = [
        asyncio.create_task(send(frontend.url, path, body(guided_json=PERSON))) for _ in range(held)
    ]
    try:
        await wait_until_async(
            lambda: len(threads) == structured_output.CONSTRAINT_POOL_THREADS,
            timeout=10,
            what="the schema checks to start",
        )
        live = await asyncio.wait_for(send(frontend.url, "/live", method="GET"), 5)
        assert live.status == 200
        plain = await asyncio.wait_for(send(frontend.url, "/v1/chat/completions", chat()), 10)
        assert plain.status == 200, plain.raw
        assert not gate.is_set(), "the plain request was served while every check was held"
    finally:
        gate.set()
    replies = await asyncio.gather(*pending)
    assert [r.status for r in replies] == [200] * held
    assert all(name.startswith("constraint-check") for name in threads), threads
    # (a check calls `validator_for` again for its meta-schema: more calls than requests)
    assert len(released) >= held and all(released), "checks were held until released"
