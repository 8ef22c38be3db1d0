"""Hostile or oversized requests: `chat_template_kwargs` may only fill the model's template
variables, chat templates render off the event loop, and the work a request can ask for
(stop strings, messages, prompt size) is bounded with a 400 naming the field, before
templating or tokenizing."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from frontend_support import (
    Frontend,
    chat_request,
    completion_request,
    make_card,
    openai_error_of,
    replaced_render,
)
from http_support import assert_openai_error, chat, send

from dynamo.frontend.openai import limits
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.frontend.preprocess.template_kwargs import template_variables
from dynamo.testing.tokenizers import CHAT_TEMPLATE
from dynamo.testing.waiting import wait_until_async

GATE_TIMEOUT_S = 3.0  # how long the blocked render waits for the test to release it


class NoEncoding:
    """Stands in for the encoder where a check must refuse before tokenizing."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str, add_special_tokens: bool) -> list[int]:
        self.calls += 1
        raise AssertionError("tokenized a request that should have been refused first")


# ---------------------------------------------------------------------- chat_template_kwargs


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},
        {"tokenize": True},
        {"return_dict": True},
        {"messages": []},
        {"not_a_template_variable": 1},
    ],
    ids=["chat_template", "tokenize", "return_dict", "messages", "unknown"],
)
async def test_chat_template_kwargs_outside_the_template_are_400(
    frontend: Frontend, kwargs: dict[str, Any]
) -> None:
    reply = await send(frontend.url, "/v1/chat/completions", chat(chat_template_kwargs=kwargs))
    (key,) = kwargs
    error = assert_openai_error(reply, 400, param=f"chat_template_kwargs.{key}")
    assert error["type"] == "invalid_request_error"
    assert frontend.client.requests == [], "no worker saw the request"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "top-level `tools`",
        ),
        ({"documents": "not a list"}, "list of objects"),
        ({"documents": [{"title": "t", "text": {"nested": 1}}]}, "list of objects"),
        ({"reasoning_effort": "extreme"}, "must be one of"),
        ({"reasoning_effort": ["low"]}, "must be one of"),
    ],
    ids=["tools", "documents_type", "documents_values", "effort_value", "effort_type"],
)
async def test_kwargs_that_shadow_top_level_fields_keep_their_rules(
    frontend: Frontend, kwargs: dict[str, Any], words: str
) -> None:
    """`tools`, `documents` and `reasoning_effort` through `chat_template_kwargs` do not
    skip the checks of their top-level counterparts."""
    reply = await send(frontend.url, "/v1/chat/completions", chat(chat_template_kwargs=kwargs))
    (key,) = kwargs
    error = assert_openai_error(reply, 400, param=f"chat_template_kwargs.{key}")
    assert words in error["message"]
    assert frontend.client.requests == [], "no worker saw the request"


async def test_valid_documents_and_reasoning_effort_kwargs_are_served(frontend: Frontend) -> None:
    kwargs = {"documents": [{"title": "t", "text": "x"}], "reasoning_effort": "low"}
    reply = await send(frontend.url, "/v1/chat/completions", chat(chat_template_kwargs=kwargs))
    assert reply.status == 200, reply.raw


def test_template_variables_and_common_switches_are_accepted(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = CHAT_TEMPLATE + "{%- if greeting -%}{{- 'GREETING:' + greeting -}}{%- endif -%}"
    monkeypatch.setattr(tokenizer, "chat_template", template)
    pre = Preprocessor(make_card(), tokenizer)
    assert "greeting" in pre.template_kwargs.accepted
    text = pre.render_chat(
        chat_request(chat_template_kwargs={"greeting": "hi", "enable_thinking": False})
    )
    assert text.endswith("GREETING:hi")
    err = openai_error_of(
        lambda: pre.render_chat(chat_request(chat_template_kwargs={"farewell": "bye"}))
    )
    assert (err.status, err.param) == (400, "chat_template_kwargs.farewell")
    assert "greeting" in err.message, "the error lists the accepted keys"


def test_template_variables_are_read_from_the_template_source() -> None:
    source = (
        "{% for m in messages %}{% generation %}{{ m.content }}{{ suffix }}"
        "{% endgeneration %}{% if stop_early %}{% break %}{% endif %}{% endfor %}"
    )
    assert template_variables([source]) == {"messages", "suffix", "stop_early"}
    assert template_variables(["{% not a template"]) == frozenset()


def test_call_flags_may_come_through_template_kwargs(preprocessor: Preprocessor) -> None:
    text = preprocessor.render_chat(
        chat_request(chat_template_kwargs={"add_generation_prompt": False})
    )
    assert not text.endswith("<|im_start|>assistant\n")
    top_level_wins = chat_request(
        add_generation_prompt=True, chat_template_kwargs={"add_generation_prompt": False}
    )
    assert preprocessor.render_chat(top_level_wins).endswith("<|im_start|>assistant\n")
    err = openai_error_of(
        lambda: preprocessor.render_chat(
            chat_request(chat_template_kwargs={"add_generation_prompt": "yes"})
        )
    )
    assert err.param == "chat_template_kwargs.add_generation_prompt"


async def test_chat_templates_render_off_the_event_loop(frontend: Frontend, tokenizer: Any) -> None:
    """A render that blocks (a slow template) must not stop the server answering others."""
    started, gate = threading.Event(), threading.Event()
    released: list[bool] = []
    original = tokenizer.apply_chat_template

    def blocking_render(*args: Any, **kwargs: Any) -> Any:
        started.set()
        released.append(gate.wait(GATE_TIMEOUT_S))  # False: nobody could release it
        return original(*args, **kwargs)

    with replaced_render(tokenizer, blocking_render):
        try:
            request = asyncio.create_task(send(frontend.url, "/v1/chat/completions", chat()))
            await wait_until_async(started.is_set, timeout=10, what="the chat template render")
            live = await send(frontend.url, "/live", method="GET")
            assert live.status == 200, "the event loop serves while the template renders"
            gate.set()
            reply = await request
        finally:
            gate.set()
    assert reply.status == 200, reply.raw
    assert released == [True], "the render was released by the test, so it ran off-loop"


# ---------------------------------------------------------------------- request-size bounds


async def test_too_many_stop_strings_are_400(frontend: Frontend) -> None:
    stops = [f"STOP{i}" for i in range(limits.MAX_STOP_STRINGS + 1)]
    reply = await send(frontend.url, "/v1/chat/completions", chat(stop=stops))
    error = assert_openai_error(reply, 400, param="stop")
    assert str(limits.MAX_STOP_STRINGS) in error["message"]
    reply = await send(frontend.url, "/v1/chat/completions", chat(stop=stops[:-1]))
    assert reply.status == 200, reply.raw


@pytest.mark.parametrize("as_list", [False, True], ids=["string", "list"])
def test_an_overlong_stop_string_is_400(preprocessor: Preprocessor, as_list: bool) -> None:
    long = "x" * (limits.MAX_STOP_CHARS + 1)
    err = openai_error_of(
        lambda: preprocessor.prepare_completion_sync(
            completion_request(stop=[long] if as_list else long), "r"
        )
    )
    assert (err.status, err.param) == (400, "stop")
    ok = "x" * limits.MAX_STOP_CHARS
    assert preprocessor.prepare_completion_sync(
        completion_request(stop=ok), "r"
    ).plan.stop_strings == (ok,)


def test_too_many_messages_are_400_before_rendering(preprocessor: Preprocessor) -> None:
    renders: list[int] = []

    def counting_render(messages: list[Any], **_kwargs: Any) -> str:
        renders.append(len(messages))
        return "hi"

    messages = [{"role": "user", "content": "hi"}] * (limits.MAX_MESSAGES + 1)
    with replaced_render(preprocessor.tokenizer, counting_render):
        err = openai_error_of(
            lambda: preprocessor.prepare_chat_sync(chat_request(messages=messages), "r")
        )
        assert (err.status, err.param) == (400, "messages")
        assert str(limits.MAX_MESSAGES) in err.message
        assert renders == [], "refused before the template ran"
        preprocessor.prepare_chat_sync(chat_request(messages=messages[1:]), "r")
    assert renders == [limits.MAX_MESSAGES]


def test_a_text_prompt_that_cannot_fit_is_400_before_tokenizing(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pre = Preprocessor(make_card(context_length=64), tokenizer)
    limit = pre.prompt_bound.max_chars(64)
    assert limit is not None and limit >= 64 * 2, "at least two characters per token"
    encoder = NoEncoding()
    monkeypatch.setattr(pre, "_encode", encoder)
    err = openai_error_of(
        lambda: pre.prepare_completion_sync(completion_request(prompt="a" * (limit + 1)), "r")
    )
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert encoder.calls == 0
    messages = [{"role": "user", "content": "a" * (limit + 1)}]
    err = openai_error_of(lambda: pre.prepare_chat_sync(chat_request(messages=messages), "r"))
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert encoder.calls == 0


def test_a_text_prompt_under_the_bound_is_still_tokenized_and_checked(tokenizer: Any) -> None:
    """The character bound never refuses what might fit: the token count decides."""
    pre = Preprocessor(make_card(context_length=64), tokenizer)
    err = openai_error_of(
        lambda: pre.prepare_completion_sync(completion_request(prompt="word " * 60), "r")
    )
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")
    assert "tokens" in err.message and "characters" not in err.message


def test_a_token_prompt_longer_than_the_context_is_refused_first(tokenizer: Any) -> None:
    pre = Preprocessor(make_card(context_length=64), tokenizer)
    ids = [1] * 63 + [10**6]  # too long, and the last id is outside the vocabulary
    err = openai_error_of(lambda: pre.prepare_completion_sync(completion_request(prompt=ids), "r"))
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert pre.prepare_completion_sync(completion_request(prompt=[1] * 63), "r").request.token_ids


# ---------------------------------------------------------------------- buffered logprobs


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_non_streamed_response_with_too_many_logprobs_is_400_before_any_worker(
    frontend: Frontend, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """n x max_tokens x (1 + top) entries are held until the response ends: bounded by
    cost, so n=16 with 20 alternatives and a long max_tokens cannot take gigabytes."""
    monkeypatch.setattr(limits, "MAX_BUFFERED_LOGPROBS", 1000)
    if path == "/v1/completions":
        body = {"model": "tiny-chat", "prompt": "Hi", "logprobs": 4, "n": 4, "temperature": 1}
    else:
        body = chat(logprobs=True, top_logprobs=4, n=4, temperature=1)
    reply = await send(frontend.url, path, {**body, "max_tokens": 51})  # 4 x 51 x 5 = 1020
    error = assert_openai_error(reply, 400, param="logprobs")
    assert "1020" in error["message"] and "Stream the response" in error["message"]
    assert frontend.client.requests == [], "no worker saw the request"
    fits = await send(frontend.url, path, {**body, "max_tokens": 50})  # 1000: at the bound
    assert fits.status == 200, fits.raw
    streamed = await send(frontend.url, path, {**body, "max_tokens": 51, "stream": True})
    assert streamed.status == 200, streamed.raw


def test_the_logprob_bound_counts_the_context_when_max_tokens_is_not_given(
    preprocessor: Preprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "MAX_BUFFERED_LOGPROBS", 100)
    request = completion_request(prompt="Hi", logprobs=1)  # no max_tokens: up to the context
    err = openai_error_of(lambda: preprocessor.prepare_completion_sync(request, "r"))
    assert (err.status, err.param) == (400, "logprobs")
    preprocessor.prepare_completion_sync(
        completion_request(prompt="Hi", logprobs=1, max_tokens=50), "r"
    )
