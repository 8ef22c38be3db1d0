"""Hostile request bodies through the HTTP app: each is a 400 that names the field where
one can be named, never a 500, and nothing of it reaches an engine.

Before the fix: invalid UTF-8 inside a JSON string and deeply nested JSON raised out of
the decoder (500), and integers of 2**64 and more in `seed` or `top_k` were accepted,
then failed when msgpack encoded the request for the worker (500, after the KV router
had booked it; `tests/integration/frontend/test_frontend_fuzz.py` checks the booking).
"""

from __future__ import annotations

from typing import Any

import pytest
from frontend_support import MODEL, Frontend
from http_support import assert_openai_error, chat, completion, send

from dynamo.frontend.openai.decoding import LOCATE_MAX_BYTES
from dynamo.frontend.openai.protocol import INT32_MAX, INT64_MAX, INT64_MIN

M = MODEL.encode()


def no_engine_call(frontend: Frontend) -> None:
    assert frontend.client.requests == [], "a rejected request must not reach the engine"


# ---------------------------------------------------------------------- invalid UTF-8


@pytest.mark.parametrize(
    ("path", "body", "param", "where"),
    [
        (
            "/v1/completions",
            b'{"model":"' + M + b'","prompt":"Say \xff\xfe hello"}',
            "prompt",
            "`prompt`",
        ),
        (
            "/v1/chat/completions",
            b'{"model":"' + M + b'","messages":[{"role":"user","content":"ok"},'
            b'{"role":"user","content":"\xc3\x28"}]}',
            "messages",
            "`messages[1].content`",
        ),
        (  # an encoded UTF-16 surrogate is not UTF-8 either
            "/v1/chat/completions",
            b'{"model":"' + M + b'","messages":[{"role":"user","content":"\xed\xa0\x80"}]}',
            "messages",
            "`messages[0].content`",
        ),
        (
            "/v1/completions",
            b'{"model":"' + M + b'","prompt":"x","stop":["ok","\x80"]}',
            "stop",
            "`stop[1]`",
        ),
        (  # a bad key of a free-form object: its object is named, the key never echoed
            "/v1/chat/completions",
            b'{"model":"' + M + b'","messages":[{"role":"user","content":"x"}],'
            b'"chat_template_kwargs":{"\xfe":1}}',
            "chat_template_kwargs",
            "`chat_template_kwargs`",
        ),
    ],
)
async def test_invalid_utf8_in_a_string_is_a_400_naming_the_field(
    frontend: Frontend, path: str, body: bytes, param: str, where: str
) -> None:
    reply = await send(frontend.url, path, body)
    error = assert_openai_error(reply, 400, param=param)
    assert where in error["message"] and "UTF-8" in error["message"]
    no_engine_call(frontend)


async def test_invalid_utf8_in_a_large_body_is_a_400_without_locating_it(
    frontend: Frontend,
) -> None:
    """Locating the field costs a second parse: bodies over 1 MiB are not worth it."""
    prompt = b"word " * (LOCATE_MAX_BYTES // 5) + b"\xff"
    body = b'{"model":"' + M + b'","prompt":"' + prompt + b'"}'
    reply = await send(frontend.url, "/v1/completions", body)
    error = assert_openai_error(reply, 400)
    assert error["param"] is None and "UTF-8" in error["message"]
    no_engine_call(frontend)


async def test_invalid_utf8_in_the_model_name_is_a_400(frontend: Frontend) -> None:
    reply = await send(frontend.url, "/v1/completions", b'{"model":"\xff","prompt":"x"}')
    assert_openai_error(reply, 400, param="model")


# ---------------------------------------------------------------------- deep nesting


def nested_arrays(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def nested_objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (  # an unknown field is skipped, but skipping recurses too
            "/v1/completions",
            b'{"model":"' + M + b'","prompt":"x","extra":' + nested_arrays(100_000) + b"}",
        ),
        (
            "/v1/chat/completions",
            b'{"model":"' + M + b'","messages":[{"role":"user","content":"x"}],'
            b'"chat_template_kwargs":' + nested_objects(50_000) + b"}",
        ),
        (
            "/v1/chat/completions",
            b'{"model":"' + M + b'","messages":[{"role":"assistant","content":"x",'
            b'"tool_calls":[' + nested_objects(5_000) + b"]}]}",
        ),
        (  # deep and invalid UTF-8 at once: no field can be located, still a 400
            "/v1/completions",
            b'{"model":"' + M + b'","prompt":"\xff","extra":' + nested_arrays(5_000) + b"}",
        ),
    ],
)
async def test_deeply_nested_json_is_a_400(frontend: Frontend, path: str, body: bytes) -> None:
    reply = await send(frontend.url, path, body)
    error = assert_openai_error(reply, 400)
    assert error["code"] in ("invalid_json", None)
    no_engine_call(frontend)


async def test_moderate_nesting_in_free_form_fields_is_still_served(frontend: Frontend) -> None:
    body = (
        b'{"model":"'
        + M
        + b'","messages":[{"role":"assistant","content":"x","tool_calls":['
        + nested_objects(200)
        + b']},{"role":"user","content":"y"}]}'
    )
    reply = await send(frontend.url, "/v1/chat/completions", body)
    assert reply.status == 200, reply.raw


# ---------------------------------------------------------------------- huge integers


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"seed": 2**64}, "seed"),
        ("/v1/completions", {"seed": INT64_MAX + 1}, "seed"),
        ("/v1/completions", {"seed": INT64_MIN - 1}, "seed"),
        ("/v1/chat/completions", {"seed": 10**30}, "seed"),
        ("/v1/completions", {"top_k": 2**64}, "top_k"),
        ("/v1/chat/completions", {"top_k": INT32_MAX + 1}, "top_k"),
        ("/v1/completions", {"max_tokens": 2**64}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": 2**64}, "max_completion_tokens"),
        ("/v1/completions", {"min_tokens": 2**64}, "min_tokens"),
        ("/v1/completions", {"n": 2**64}, "n"),
        ("/v1/completions", {"logprobs": 2**64}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2**64}, "top_logprobs"),
        ("/v1/completions", {"stop_token_ids": [2**64]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": [1, 2**64]}, "prompt"),
    ],
)
async def test_integers_beyond_their_range_are_a_400_naming_the_field(
    frontend: Frontend, path: str, fields: dict[str, Any], param: str
) -> None:
    base = completion() if path == "/v1/completions" else chat()
    reply = await send(frontend.url, path, {**base, **fields})
    assert_openai_error(reply, 400, param=param)
    no_engine_call(frontend)


@pytest.mark.parametrize("seed", [INT64_MIN, -1, 0, INT64_MAX])
async def test_seeds_across_the_int64_range_are_served(frontend: Frontend, seed: int) -> None:
    reply = await send(frontend.url, "/v1/completions", completion(seed=seed))
    assert reply.status == 200, reply.raw
    assert frontend.client.requests[-1].sampling_options.seed == seed


async def test_top_k_disable_values_still_work(frontend: Frontend) -> None:
    for top_k in (-1, 0, 40):
        reply = await send(frontend.url, "/v1/completions", completion(top_k=top_k))
        assert reply.status == 200, reply.raw
