"""Every OpenAI chat/completions field (and the vLLM extensions clients send through
`extra_body`) is either served or refused with a 400 naming it; nothing is silently
ignored except fields outside both schemas, which a debug log line lists.

Claims:
* each field of `unsupported_fields.SUPPORT`, sent to a running frontend with a value that
  exercises it, is a 400 whose `param` is the field when the table says `refused`, and a
  200 when it says `honoured` or `accepted`;
* a refused field carrying its neutral value (`n: 1`, `tool_choice: "none"`, ...) is served;
* the support table in docs/frontend.md lists exactly the code's table;
* the table covers every field of the installed `openai` package's create-params;
* unknown fields are ignored (200) and named in one debug log line.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from frontend_support import MODEL, Frontend, start_frontend

from dynamo.frontend.openai.unsupported_fields import SUPPORT, Endpoint, Support, fields_for

DOCS = Path(__file__).resolve().parents[3] / "docs" / "frontend.md"
PATHS = {
    Endpoint.CHAT: "/v1/chat/completions",
    Endpoint.COMPLETIONS: "/v1/completions",
    Endpoint.RESPONSES: "/v1/responses",
}
BASE: dict[Endpoint, dict[str, Any]] = {
    Endpoint.CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    Endpoint.COMPLETIONS: {"model": MODEL, "prompt": "Hi"},
    Endpoint.RESPONSES: {"model": MODEL, "input": "Hi", "max_output_tokens": 3},
}
# A short template that reads `tools` (the tiny model's has none; its context is short).
TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if tools %}{{ tools | length }} tools\n{% endif %}assistant:"
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# Fields (added to BASE) that exercise each entry: a non-neutral value, with any companion
# field it needs. Keyed by (endpoint, field); the coverage test keeps it in step with SUPPORT.
COMMON: dict[str, dict[str, Any]] = {
    "model": {"model": MODEL},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "max_tokens": {"max_tokens": 3},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "seed": {"seed": 7},
    "stop": {"stop": ["zz"]},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "response_format": {"response_format": {"type": "json_object"}},
    "user": {"user": "someone"},
    "n": {"n": 2},
    "logit_bias": {"logit_bias": {"5": 10}},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "stop_token_ids": {"stop_token_ids": [5]},
    "ignore_eos": {"ignore_eos": True, "max_tokens": 4},
    "min_tokens": {"min_tokens": 1},
    "skip_special_tokens": {"skip_special_tokens": False},
    "structured_outputs": {"structured_outputs": {"regex": "[a-z]+"}},
    "guided_json": {"guided_json": {"type": "object"}},
    "guided_regex": {"guided_regex": "[a-z]+"},
    "guided_choice": {"guided_choice": ["yes", "no"]},
    "guided_grammar": {"guided_grammar": 'root ::= "yes" | "no"'},
    "guided_whitespace_pattern": {
        "guided_json": {"type": "object"},
        "guided_whitespace_pattern": " ",
    },
    "return_spec_stats": {"return_spec_stats": True},
    "speculative_decoding": {"speculative_decoding": False},
    "priority": {"priority": -2},
    "use_beam_search": {"use_beam_search": True},
    "length_penalty": {"use_beam_search": True, "length_penalty": 0.5, "max_tokens": 3},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 5},
    "truncation_side": {"truncation_side": "left"},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "allowed_token_ids": {"allowed_token_ids": [1, 2]},
    "bad_words": {"bad_words": ["bad"]},
    "add_special_tokens": {"add_special_tokens": True},
    "logits_processors": {"logits_processors": ["my.module:Processor"]},
    "thinking_token_budget": {"thinking_token_budget": 5},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "return_token_ids": {"return_token_ids": True},
    "vllm_xargs": {"vllm_xargs": {"k": 1}},
}
CHAT_ONLY: dict[str, dict[str, Any]] = {
    "messages": {"messages": [{"role": "user", "content": "Hello"}]},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "metadata": {"metadata": {"k": "v"}},
    "store": {"store": True},
    "service_tier": {"service_tier": "auto"},
    "safety_identifier": {"safety_identifier": "s"},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit"}},
    "parallel_tool_calls": {
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    },
    "tools": {"tools": [TOOL], "tool_choice": "required"},
    "tool_choice": {
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    },
    "functions": {"functions": [{"name": "f", "parameters": {}}]},
    "function_call": {"function_call": "auto"},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "modalities": {"modalities": ["text", "audio"]},
    "prediction": {"prediction": {"type": "content", "content": "Hi"}},
    "web_search_options": {"web_search_options": {}},
    "reasoning_effort": {"reasoning_effort": "low"},
    "verbosity": {"verbosity": "low"},
    "moderation": {"moderation": {"model": "m"}},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hel"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "echo": {"echo": True},
    "logprob_token_ids": {"logprobs": True, "logprob_token_ids": [1]},
    "documents": {"documents": [{"title": "t", "text": "x"}]},
    "chat_template": {"chat_template": "{{ messages }}"},
    "include_reasoning": {"include_reasoning": False},
}
COMPLETIONS_ONLY: dict[str, dict[str, Any]] = {
    "prompt": {"prompt": [5, 6, 7]},
    "logprobs": {"logprobs": 2},
    "echo": {"echo": True},
    "logprob_token_ids": {"logprobs": 1, "logprob_token_ids": [1]},
    "best_of": {"best_of": 2},
    "suffix": {"suffix": "tail"},
    "prompt_embeds": {"prompt_embeds": "AAAA"},
}
# The Responses endpoint's table lists only what it refuses.
RESPONSES_REFUSED: dict[str, dict[str, Any]] = {
    "previous_response_id": {"previous_response_id": "resp_1"},
    "conversation": {"conversation": "conv_1"},
    "background": {"background": True},
    "tools": {"tools": [TOOL]},
    "tool_choice": {"tool_choice": "required"},
    "max_tool_calls": {"max_tool_calls": 2},
    "reasoning": {"reasoning": {"effort": "high"}},
    "include": {"include": ["reasoning.encrypted_content"]},
    "prompt": {"prompt": {"id": "pmpt_1"}},
    "top_logprobs": {"top_logprobs": 2},
    "truncation": {"truncation": "auto"},
    "context_management": {"context_management": [{"type": "compaction"}]},
}
SAMPLES: dict[Endpoint, dict[str, dict[str, Any]]] = {
    Endpoint.CHAT: {**COMMON, **CHAT_ONLY},
    Endpoint.COMPLETIONS: {**COMMON, **COMPLETIONS_ONLY},
    Endpoint.RESPONSES: RESPONSES_REFUSED,
}

# Refused fields with a value that changes nothing: served.
NEUTRAL = [
    (Endpoint.CHAT, {"n": 1}),
    (Endpoint.COMPLETIONS, {"best_of": 1, "n": 1}),
    (Endpoint.CHAT, {"tool_choice": "none", "tools": []}),
    (Endpoint.CHAT, {"function_call": "none"}),
    (Endpoint.CHAT, {"modalities": ["text"]}),
    (Endpoint.CHAT, {"logit_bias": {}, "audio": None, "prediction": None}),
    (Endpoint.COMPLETIONS, {"suffix": "", "use_beam_search": False, "length_penalty": 1.0}),
    (Endpoint.CHAT, {"spaces_between_special_tokens": True, "include_reasoning": True}),
    (Endpoint.RESPONSES, {"tool_choice": "auto", "tools": [], "truncation": "disabled"}),
    (Endpoint.RESPONSES, {"reasoning": {"effort": None}, "top_logprobs": 0, "include": []}),
    (Endpoint.RESPONSES, {"previous_response_id": "", "background": False}),
]


@pytest.fixture(scope="module")
async def frontend(tokenizer: Any) -> AsyncIterator[Frontend]:
    """One frontend for the module (a hundred-odd requests, none changes its state)."""
    tools_tokenizer = copy.copy(tokenizer)
    tools_tokenizer.chat_template = TOOLS_TEMPLATE
    running = await start_frontend(tools_tokenizer)
    try:
        yield running
    finally:
        await running.service.stop()


def cases() -> list[Any]:
    return [
        pytest.param(endpoint, entry.name, entry.support, id=f"{endpoint}-{entry.name}")
        for endpoint in Endpoint
        for entry in fields_for(endpoint)
    ]


async def post(frontend: Frontend, endpoint: Endpoint, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(frontend.url + PATHS[endpoint], json=body) as resp:
            raw = await resp.read()
            is_json = resp.content_type == "application/json"
            return resp.status, (await resp.json() if is_json else raw)


@pytest.mark.parametrize("endpoint,name,support", cases())
async def test_every_listed_field_is_honoured_or_refused_with_a_400_naming_it(
    frontend: Frontend, endpoint: Endpoint, name: str, support: Support
) -> None:
    sent_before = len(frontend.client.requests)
    status, body = await post(frontend, endpoint, {**BASE[endpoint], **SAMPLES[endpoint][name]})
    if support is Support.REFUSED:
        assert status == 400, body
        assert body["error"]["param"] == name
        assert name in body["error"]["message"]
        assert len(frontend.client.requests) == sent_before, "a refused request reached a worker"
    else:
        assert status == 200, body


@pytest.mark.parametrize("endpoint,fields", NEUTRAL)
async def test_a_refused_field_with_its_neutral_value_is_served(
    frontend: Frontend, endpoint: Endpoint, fields: dict[str, Any]
) -> None:
    status, body = await post(frontend, endpoint, {**BASE[endpoint], **fields})
    assert status == 200, body


def test_the_samples_cover_exactly_the_table() -> None:
    for endpoint in Endpoint:
        assert set(SAMPLES[endpoint]) == {e.name for e in fields_for(endpoint)}, endpoint


def test_the_table_covers_every_field_of_the_openai_client() -> None:
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    # A TypedDict's `__annotations__` holds its fields, inherited ones included.
    expected = {
        Endpoint.CHAT: set(chat.CompletionCreateParamsStreaming.__annotations__),
        Endpoint.COMPLETIONS: set(completions.CompletionCreateParamsStreaming.__annotations__),
    }
    for endpoint, names in expected.items():
        assert "model" in names and "stream" in names
        listed = {e.name for e in fields_for(endpoint) if not e.vllm_extension}
        assert names - listed == set(), f"{endpoint}: OpenAI fields missing from the table"


def _docs_rows() -> set[tuple[str, str, str]]:
    text = DOCS.read_text()
    start = text.index("<!-- support-table:start -->")
    end = text.index("<!-- support-table:end -->")
    rows = set()
    for line in text[start:end].splitlines():
        match = re.match(r"\|\s*`([a-z_]+)`\s*\|\s*([a-z]+)\s*\|\s*([a-z]+)\s*\|", line)
        if match:
            rows.add((match[1], match[2], match[3]))
    return rows


def test_the_docs_support_table_matches_the_code() -> None:
    expected = {(e.name, e.endpoint_label, e.support.value) for e in SUPPORT}
    assert _docs_rows() == expected


async def test_unknown_fields_are_ignored_and_listed_in_one_debug_line(
    frontend: Frontend, caplog: pytest.LogCaptureFixture
) -> None:
    body = {**BASE[Endpoint.CHAT], "frobnicate": 1, "aardvark": {"x": [1]}}
    with caplog.at_level(logging.DEBUG, logger="dynamo.frontend.openai.unsupported_fields"):
        status, reply = await post(frontend, Endpoint.CHAT, body)
    assert status == 200, reply
    lines = [r.getMessage() for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert lines == ["ignored unknown request fields: aardvark, frobnicate"]


async def test_known_fields_are_not_logged_as_unknown(
    frontend: Frontend, caplog: pytest.LogCaptureFixture
) -> None:
    body = {**BASE[Endpoint.COMPLETIONS], "user": "u", "top_k": 3, "echo": False}
    with caplog.at_level(logging.DEBUG, logger="dynamo.frontend.openai.unsupported_fields"):
        status, reply = await post(frontend, Endpoint.COMPLETIONS, body)
    assert status == 200, reply
    assert not [r for r in caplog.records if "unknown request fields" in r.getMessage()]


async def test_the_unknown_field_log_line_is_bounded(
    frontend: Frontend, caplog: pytest.LogCaptureFixture
) -> None:
    names = {f"x{i:03d}" + "y" * 100: i for i in range(30)}
    body = {**BASE[Endpoint.CHAT], **names}
    with caplog.at_level(logging.DEBUG, logger="dynamo.frontend.openai.unsupported_fields"):
        status, reply = await post(frontend, Endpoint.CHAT, body)
    assert status == 200, reply
    (line,) = [r.getMessage() for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert line.endswith("(and 10 more)") and len(line) < 20 * 70 + 100
