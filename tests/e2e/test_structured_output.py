"""Structured output with the real embedded model behind the frontend (vLLM's structured
outputs, xgrammar on CPU), driven by the official `openai` client.

Claims:
* `response_format` `json_schema` output parses and validates against its schema for 20
  prompts (sent concurrently, so constrained requests share batches);
* `json_object`, `structured_outputs.choice` and `guided_regex` constrain the output;
* a schema only the worker's grammar compiler can judge (a feature xgrammar does not
  support) comes back as a 400 naming it, not a 500;
* with n-gram speculation, structured greedy output equals structured greedy output
  without speculation, token for token (vLLM trims each step's drafts to the longest
  prefix the grammar accepts and masks every verified position with the grammar).

Uses the session's shared workers (`conftest.py`): one plain, one with n-gram.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from e2e_prompts import chat_ids, greedy_request

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.llm.protocols import LLMEngineOutput, StructuredOutput
from dynamo.runtime import DistributedRuntime
from dynamo.testing.chat_bodies import PEOPLE_TO_DESCRIBE
from dynamo.testing.processes import FrontendProcess, WorkerProcess

MODEL = DEFAULT_MODEL
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = [
    "Ada Lovelace, born in London",
    "Alan Turing from Manchester",
    "Marie Curie of Paris",
    "Albert Einstein in Bern",
    "Grace Hopper in New York",
    "Linus Torvalds from Helsinki",
    "Katherine Johnson in Hampton",
    "Nikola Tesla, Smiljan",
    "Rosalind Franklin, London",
    "Niels Bohr of Copenhagen",
    *PEOPLE_TO_DESCRIBE,
    "a doctor in Toronto",
    "a poet from Dublin",
]
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


@pytest.fixture(scope="module")
def client(frontend: FrontendProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0)


async def test_json_schema_output_validates_for_20_prompts(client: openai.AsyncOpenAI) -> None:
    async def one(who: str) -> str:
        result = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe {who} as JSON."}],
            response_format=SCHEMA_FORMAT,  # type: ignore[arg-type]
            max_tokens=120,
            temperature=0.0,
        )
        choice = result.choices[0]
        assert choice.finish_reason == "stop", choice
        return choice.message.content or ""

    texts = await asyncio.gather(*(one(who) for who in PEOPLE))
    for who, text in zip(PEOPLE, texts, strict=True):
        assert _valid(text), f"{who}: {text!r}"


async def test_json_object_choice_and_guided_regex(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "Is the sky blue? Answer."}]
    obj = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0.0,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:  # cut at max_tokens: still the start of an object
        assert (obj.choices[0].message.content or "").lstrip().startswith("{")
    choice = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        max_tokens=10,
    )
    assert choice.choices[0].message.content in ("yes", "no")
    regex = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What year did WW2 end?"}],  # type: ignore[list-item]
        extra_body={"guided_regex": "[0-9]{4}"},
        max_tokens=10,
    )
    assert re.fullmatch("[0-9]{4}", regex.choices[0].message.content or "")


async def test_schema_the_grammar_compiler_refuses_is_a_400(client: openai.AsyncOpenAI) -> None:
    # Valid JSON schema (the frontend passes it), but not one xgrammar can compile.
    schema = {"type": "string", "format": "no-such-format"}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            max_tokens=8,
        )
    assert "no-such-format" in str(info.value)  # vLLM names the problem


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def _structured_greedy(
    runtime: DistributedRuntime, worker: WorkerProcess, token_ids: list[int]
) -> list[int]:
    endpoint = runtime.namespace(worker.namespace).component(worker.component)
    client = await endpoint.endpoint("generate").client()
    await client.wait_for_instances(timeout=30)
    req = greedy_request(token_ids, 96, model="test")
    req.structured_output = StructuredOutput(json_schema=json.dumps(PERSON))
    tokens: list[int] = []
    async for out in client.round_robin(req, response_type=LLMEngineOutput):
        tokens.extend(out.token_ids)
    return tokens


async def test_ngram_structured_output_equals_no_speculation(
    runtime, ngram_worker, plain_worker, tokenizer
) -> None:
    drafted_before = ngram_worker.metric("vllm:spec_decode_num_draft_tokens_total")
    for who in PEOPLE[:4]:
        ids = chat_ids(tokenizer, f"Describe {who} as JSON with name, age and city.")
        spec = await _structured_greedy(runtime, ngram_worker, ids)
        plain = await _structured_greedy(runtime, plain_worker, ids)
        assert spec == plain, (
            f"speculation changed structured output for {who!r}:\n"
            f"spec : {tokenizer.decode(spec)!r}\nplain: {tokenizer.decode(plain)!r}"
        )
        jsonschema.validate(json.loads(tokenizer.decode(spec, skip_special_tokens=True)), PERSON)
    # The proposer really ran on these constrained requests.
    assert ngram_worker.metric("vllm:spec_decode_num_draft_tokens_total") > drafted_before
