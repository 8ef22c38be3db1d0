"""vLLM's request extensions that the frontend serves itself, with the meaning `vllm serve`
gives them: `truncate_prompt_tokens` / `truncation_side`, `add_special_tokens`,
`return_token_ids`, `return_tokens_as_token_ids`, `include_stop_str_in_output`, chat
`echo`, and `reasoning_effort` / `documents` for the chat template.

Claims (over a running frontend and the scripted engine, real tokenizer):
* truncation keeps the prompt's last N tokens (first N with `right`), applies after the
  chat template and to token-id prompts, counts in usage, and refuses what vLLM refuses;
  a prompt too long for the context is served once truncation is asked for;
* `add_special_tokens` reaches the tokenizer with vLLM's defaults per endpoint;
* `return_token_ids` gives the prompt's ids and each choice's ids (the final EOS
  included), streamed and not; the streamed pieces add up to the unary answer;
* `return_tokens_as_token_ids` names every logprob token `token_id:N`;
* `include_stop_str_in_output` keeps the stop string, or the stop token's text, and
  nothing after it; the stop that completes first wins (vLLM's rule);
* chat `echo` starts the reply with the last message when the assistant wrote it;
* `reasoning_effort` and `documents` reach the chat template as vLLM passes them;
* `prompt_logprobs` come in vLLM's shape (null first, the prompt token first with its
  rank), follow vLLM's rules (-1, not streamed unless 0) and the logprobs bound; with
  completions' `echo` and `logprobs` the prompt's logprobs lead `logprobs`;
* `logprob_token_ids` report the sampled token then the chosen ones, in that order, and
  are refused as vLLM refuses them.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from frontend_support import (
    EOS,
    MODEL,
    Frontend,
    Script,
    chat_request,
    completion_request,
    make_card,
    openai_error_of,
    parse_sse,
    replaced_render,
)

from dynamo.frontend.postprocess.stop_strings import StopStringMatcher
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.frontend.preprocess.tokenizer_setup import load_tokenizer
from dynamo.testing.tokenizers import build_tiny_tokenizer

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


async def post(frontend: Frontend, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(frontend.url + path, json={"model": MODEL, **body}) as resp:
            return resp.status, await resp.json()


async def stream(frontend: Frontend, path: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as session:
        payload = {"model": MODEL, "stream": True, **body}
        async with session.post(frontend.url + path, json=payload) as resp:
            assert resp.status == 200, await resp.text()
            events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


# ---------------------------------------------------------------------- truncation


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_truncation_keeps_the_asked_end_of_a_text_prompt(
    preprocessor: Preprocessor, tokenizer: Any, side: str | None
) -> None:
    full = ids_of(tokenizer, LONG_PROMPT)
    assert len(full) > 8
    request = completion_request(prompt=LONG_PROMPT, truncate_prompt_tokens=8, truncation_side=side)
    kept = preprocessor.prepare_completion_sync(request, "r").request.token_ids
    assert kept == (full[:8] if side == "right" else full[-8:])


def test_truncation_applies_to_token_prompts_and_after_the_chat_template(
    preprocessor: Preprocessor, tokenizer: Any
) -> None:
    ids = list(range(10, 30))
    request = completion_request(prompt=ids, truncate_prompt_tokens=5)
    assert preprocessor.prepare_completion_sync(request, "r").request.token_ids == ids[-5:]
    chat = chat_request(messages=[{"role": "user", "content": LONG_PROMPT}])
    whole = preprocessor.prepare_chat_sync(chat, "r").request.token_ids
    cut = chat_request(
        messages=[{"role": "user", "content": LONG_PROMPT}], truncate_prompt_tokens=6
    )
    # The template's end (the assistant's turn) is what left truncation keeps.
    assert preprocessor.prepare_chat_sync(cut, "r").request.token_ids == whole[-6:]


def test_minus_one_fits_a_prompt_longer_than_the_context(
    preprocessor: Preprocessor, tokenizer: Any
) -> None:
    context = preprocessor.context_length
    text = LONG_PROMPT * 40
    assert len(ids_of(tokenizer, text)) > context
    refused = openai_error_of(
        lambda: preprocessor.prepare_completion_sync(completion_request(prompt=text), "r")
    )
    assert refused.status == 400
    request = completion_request(prompt=text, truncate_prompt_tokens=-1, max_tokens=1)
    prepared = preprocessor.prepare_completion_sync(request, "r")
    assert len(prepared.request.token_ids) == context - 1
    assert prepared.request.token_ids == ids_of(tokenizer, text)[-(context - 1) :]


def test_a_text_far_over_the_character_bound_is_trimmed_before_tokenizing(
    preprocessor: Preprocessor,
) -> None:
    limit = preprocessor.prompt_bound.max_chars(preprocessor.context_length)
    assert limit is not None
    text = "a" * (limit * 3)
    request = completion_request(prompt=text, truncate_prompt_tokens=4, max_tokens=1)
    assert len(preprocessor.prepare_completion_sync(request, "r").request.token_ids) == 4


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 4, "truncation_side": "middle"}, "truncation_side"),
        ({"truncation_side": "up"}, "truncation_side"),
    ],
)
async def test_truncation_values_vllm_refuses_are_a_400_naming_the_field(
    frontend: Frontend, fields: dict[str, Any], param: str
) -> None:
    status, body = await post(frontend, "/v1/completions", {"prompt": "Hi there", **fields})
    assert status == 400, body
    assert body["error"]["param"] == param


async def test_usage_counts_the_truncated_prompt(frontend: Frontend) -> None:
    status, body = await post(
        frontend, "/v1/completions", {"prompt": LONG_PROMPT, "truncate_prompt_tokens": 7}
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 7
    assert len(frontend.client.requests[-1].token_ids) == 7


# ---------------------------------------------------------------------- add_special_tokens


@pytest.fixture(scope="module")
def bos_preprocessor(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    """The tiny tokenizer with a post-processor that adds a special token in front (what a
    BOS-adding tokenizer does), so `add_special_tokens` is visible in the ids."""
    from tokenizers import processors

    tokenizer = load_tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("bos-tokenizer")))
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_end|> $A", special_tokens=[("<|im_end|>", EOS)]
    )
    return Preprocessor(make_card(), tokenizer)


@pytest.mark.parametrize(
    "endpoint,value,adds",
    [
        ("completions", None, True),
        ("completions", False, False),
        ("chat", None, False),
        ("chat", True, True),
    ],
)
def test_add_special_tokens_follows_vllms_default_per_endpoint(
    bos_preprocessor: Preprocessor, endpoint: str, value: bool | None, adds: bool
) -> None:
    if endpoint == "completions":
        request = completion_request(prompt="Hello there", add_special_tokens=value)
        ids = bos_preprocessor.prepare_completion_sync(request, "r").request.token_ids
    else:
        chat = chat_request(add_special_tokens=value)
        ids = bos_preprocessor.prepare_chat_sync(chat, "r").request.token_ids
    assert (ids[0] == EOS) is adds


# ---------------------------------------------------------------------- token ids


async def test_return_token_ids_gives_the_prompt_and_the_generated_ids(
    frontend: Frontend, tokenizer: Any
) -> None:
    reply_ids = ids_of(tokenizer, frontend.engine.script.reply)
    status, body = await post(
        frontend, "/v1/completions", {"prompt": "Say hello", "return_token_ids": True}
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == frontend.client.requests[-1].token_ids
    assert choice["token_ids"] == [*reply_ids, EOS]  # the EOS is a generated token
    status, chat = await post(
        frontend,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "return_token_ids": True},
    )
    assert status == 200, chat
    assert chat["prompt_token_ids"] == frontend.client.requests[-1].token_ids
    assert chat["choices"][0]["token_ids"] == [*reply_ids, EOS]
    status, plain = await post(frontend, "/v1/completions", {"prompt": "Say hello"})
    assert "token_ids" not in plain["choices"][0]
    assert "prompt_token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_streamed_token_ids_add_up_and_the_prompt_comes_first(
    frontend: Frontend, tokenizer: Any, path: str
) -> None:
    frontend.engine.script = Script(steps=(1, 3))
    reply_ids = ids_of(tokenizer, frontend.engine.script.reply)
    body: dict[str, Any] = {"return_token_ids": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Say hello"
    chunks = await stream(frontend, path, body)
    prompt_ids = frontend.client.requests[-1].token_ids
    streamed = [tid for chunk in chunks for tid in chunk["choices"][0].get("token_ids", [])]
    assert streamed == [*reply_ids, EOS]
    if path.endswith("chat/completions"):
        carriers = [i for i, chunk in enumerate(chunks) if "prompt_token_ids" in chunk]
        assert carriers == [0] and chunks[0]["prompt_token_ids"] == prompt_ids
    else:
        carriers = [i for i, c in enumerate(chunks) if "prompt_token_ids" in c["choices"][0]]
        assert carriers == [0] and chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids


async def test_return_tokens_as_token_ids_names_every_logprob_token(
    frontend: Frontend, tokenizer: Any
) -> None:
    reply_ids = ids_of(tokenizer, frontend.engine.script.reply)
    status, body = await post(
        frontend,
        "/v1/completions",
        {"prompt": "Say hello", "logprobs": 2, "return_tokens_as_token_ids": True},
    )
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    # Every generated token's, the final EOS included (as vLLM reports them).
    assert logprobs["tokens"] == [f"token_id:{t}" for t in [*reply_ids, EOS]]
    assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"] for k in top)
    status, chat = await post(
        frontend,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "logprobs": True,
            "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
    )
    assert status == 200, chat
    content = chat["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in [*reply_ids, EOS]]
    assert all(top["token"].startswith("token_id:") for e in content for top in e["top_logprobs"])


# ---------------------------------------------------------------------- stop strings


def test_the_stop_that_completes_first_wins_as_in_vllm() -> None:
    # "bc" completes at 3, "abcd" at 4: vLLM stops at "bc", whatever the deltas.
    whole = StopStringMatcher(["abcd", "bc"])
    assert whole.feed("xabcd") == ("xa", "bc")
    by_char = StopStringMatcher(["abcd", "bc"])
    out = [by_char.feed(ch) for ch in "xabcd"]
    assert "".join(text for text, _ in out) == "xa" and out[-2][1] == "bc"


def test_an_included_stop_string_ends_the_text_even_across_deltas() -> None:
    matcher = StopStringMatcher(["Hello"], include_in_output=True)
    assert matcher.feed("Say Hel") == ("Say Hel", None)  # nothing held back
    assert matcher.feed("lo world") == ("lo", "Hello")
    assert matcher.flush() == ""
    unmatched = StopStringMatcher(["Hello"], include_in_output=True)
    assert unmatched.feed("Say Hel") == ("Say Hel", None)
    assert unmatched.flush() == ""  # already sent


@pytest.mark.parametrize("stream_it", [False, True])
async def test_include_stop_str_in_output_keeps_the_stop_and_nothing_after(
    frontend: Frontend, stream_it: bool
) -> None:
    body = {"prompt": "Say hello", "stop": ["there"], "include_stop_str_in_output": True}
    if stream_it:
        chunks = await stream(frontend, "/v1/completions", body)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        status, reply = await post(frontend, "/v1/completions", body)
        assert status == 200, reply
        text = reply["choices"][0]["text"]
    assert text == "Hello there"
    status, plain = await post(
        frontend, "/v1/completions", {**body, "include_stop_str_in_output": False}
    )
    assert plain["choices"][0]["text"] == "Hello "


async def test_include_stop_str_in_output_keeps_the_stop_tokens_text(frontend: Frontend) -> None:
    body = {"prompt": "Say hello", "skip_special_tokens": False}
    status, hidden = await post(frontend, "/v1/completions", body)
    status, kept = await post(
        frontend, "/v1/completions", {**body, "include_stop_str_in_output": True}
    )
    assert status == 200, kept
    assert kept["choices"][0]["text"] == hidden["choices"][0]["text"] + "<|im_end|>"


# ---------------------------------------------------------------------- chat echo


async def test_chat_echo_starts_the_reply_with_the_assistants_last_message(
    frontend: Frontend,
) -> None:
    reply = frontend.engine.script.reply
    messages = [
        {"role": "user", "content": "Greet me"},
        {"role": "assistant", "content": "Well, "},
    ]
    body = {
        "messages": messages,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    status, unary = await post(frontend, "/v1/chat/completions", body)
    assert status == 200, unary
    assert unary["choices"][0]["message"]["content"] == "Well, " + reply
    chunks = await stream(frontend, "/v1/chat/completions", body)
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"].startswith("Well, ")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Well, " + reply
    status, user_last = await post(
        frontend, "/v1/chat/completions", {"messages": messages[:1], "echo": True}
    )
    assert user_last["choices"][0]["message"]["content"] == reply


# ---------------------------------------------------------------------- template variables


def _render_kwargs(preprocessor: Preprocessor, **fields: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def render(messages: Any, **kwargs: Any) -> str:
        seen.update(kwargs)
        return "rendered"

    with replaced_render(preprocessor.tokenizer, render):
        preprocessor.render_chat(chat_request(**fields))
    return seen


def test_reasoning_effort_and_documents_reach_the_template_as_vllm_passes_them(
    preprocessor: Preprocessor,
) -> None:
    docs = [{"title": "Canals", "text": "Canals carry boats."}]
    seen = _render_kwargs(preprocessor, reasoning_effort="low", documents=docs)
    assert seen["documents"] == docs
    assert seen["reasoning_effort"] == "low" and seen["enable_thinking"] is True
    assert _render_kwargs(preprocessor, reasoning_effort="none")["enable_thinking"] is False
    kept = _render_kwargs(
        preprocessor, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}
    )
    assert kept["enable_thinking"] is False  # the request's own kwarg wins
    top_wins = _render_kwargs(
        preprocessor, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}
    )
    assert top_wins["reasoning_effort"] == "high"
    assert "enable_thinking" not in _render_kwargs(preprocessor)


async def test_bad_reasoning_effort_or_documents_are_a_400(frontend: Frontend) -> None:
    base = {"messages": [{"role": "user", "content": "Hi"}]}
    status, body = await post(
        frontend, "/v1/chat/completions", {**base, "reasoning_effort": "huge"}
    )
    assert status == 400 and body["error"]["param"] == "reasoning_effort"
    status, body = await post(
        frontend, "/v1/chat/completions", {**base, "documents": [{"title": 3}]}
    )
    assert status == 400, body


# ---------------------------------------------------------------------- prompt logprobs


async def test_prompt_logprobs_have_vllms_shape_in_completions_and_chat(
    frontend: Frontend, tokenizer: Any
) -> None:
    status, body = await post(
        frontend, "/v1/completions", {"prompt": "Say hello there", "prompt_logprobs": 2}
    )
    assert status == 200, body
    prompt = frontend.client.requests[-1].token_ids
    assert frontend.client.requests[-1].output_options.prompt_logprobs == 2
    positions = body["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(prompt) and positions[0] is None
    for token, position in zip(prompt[1:], positions[1:], strict=True):
        assert list(position) == [str(token), "100", "101"]  # the prompt token first
        own = position[str(token)]
        assert own == {
            "logprob": -0.5,
            "rank": 2,
            "decoded_token": tokenizer.decode([token]),
        }
    status, chat = await post(
        frontend,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0},
    )
    assert status == 200, chat
    prompt = frontend.client.requests[-1].token_ids
    assert len(chat["prompt_logprobs"]) == len(prompt)
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
    status, plain = await post(frontend, "/v1/completions", {"prompt": "Say hello"})
    assert "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize(
    "fields,served",
    [
        ({"prompt_logprobs": -2}, False),
        ({"prompt_logprobs": 1, "stream": True}, False),
        ({"prompt_logprobs": -1, "stream": True}, False),
        ({"prompt_logprobs": 0, "stream": True}, True),
        ({"prompt_logprobs": -1}, True),
    ],
)
async def test_prompt_logprobs_follow_vllms_rules(
    frontend: Frontend, fields: dict[str, Any], served: bool
) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "Say hello", **fields}
        async with session.post(frontend.url + "/v1/completions", json=body) as resp:
            raw = await resp.read()
            assert (resp.status == 200) is served, raw
            if not served:
                assert json.loads(raw)["error"]["param"] == "prompt_logprobs"


def test_prompt_logprobs_count_against_the_logprobs_bound(tokenizer: Any) -> None:
    """-1 asks for the whole vocabulary at every prompt position: refused before any
    worker when the response would hold more than the bound; fewer pass."""
    from dynamo.frontend.openai.limits import MAX_BUFFERED_LOGPROBS

    wide = Preprocessor(make_card(context_length=1_000_000), tokenizer)
    over = MAX_BUFFERED_LOGPROBS // (1 + wide.vocab_size) + 1
    prompt = [5] * over
    request = completion_request(prompt=prompt, prompt_logprobs=-1, max_tokens=1)
    error = openai_error_of(lambda: wide.prepare_completion_sync(request, "r"))
    assert error.status == 400 and error.param == "prompt_logprobs"
    fewer = completion_request(prompt=prompt, prompt_logprobs=1, max_tokens=1)
    assert wide.prepare_completion_sync(fewer, "r").request.output_options.prompt_logprobs == 1


@pytest.mark.parametrize("stream_it", [False, True])
async def test_echo_with_logprobs_reports_the_prompts_logprobs_first(
    frontend: Frontend, tokenizer: Any, stream_it: bool
) -> None:
    body = {"prompt": "Say hello", "echo": True, "logprobs": 1, "max_tokens": 3}
    if stream_it:
        chunks = await stream(frontend, "/v1/completions", body)
        first = chunks[0]["choices"][0]["logprobs"]
        tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
        token_logprobs = [
            v for c in chunks if c["choices"] for v in c["choices"][0]["logprobs"]["token_logprobs"]
        ]
        offsets = first["text_offset"]
    else:
        status, reply = await post(frontend, "/v1/completions", body)
        assert status == 200, reply
        first = reply["choices"][0]["logprobs"]
        tokens, token_logprobs, offsets = (
            first["tokens"],
            first["token_logprobs"],
            first["text_offset"],
        )
        assert len(reply["choices"][0]["prompt_logprobs"]) == len(
            frontend.client.requests[-1].token_ids
        )
    prompt = frontend.client.requests[-1].token_ids
    assert frontend.client.requests[-1].output_options.prompt_logprobs == 1
    reply_ids = ids_of(tokenizer, frontend.engine.script.reply)[:3]
    assert tokens == [tokenizer.decode([t]) for t in [*prompt, *reply_ids]]
    assert token_logprobs[0] is None and token_logprobs[1 : len(prompt)] == [-0.5] * (
        len(prompt) - 1
    )
    assert offsets[0] == 0


# ---------------------------------------------------------------------- logprob_token_ids


async def test_logprob_token_ids_report_the_sampled_token_then_the_chosen_ones(
    frontend: Frontend, tokenizer: Any
) -> None:
    chosen = [7, 5, 9]
    reply_ids = ids_of(tokenizer, frontend.engine.script.reply)
    status, chat = await post(
        frontend,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "logprobs": True,
            "logprob_token_ids": chosen,
        },
    )
    assert status == 200, chat
    sent = frontend.client.requests[-1].output_options
    assert sent.logprob_token_ids == chosen and sent.logprobs is None  # as vLLM sends them
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == len(reply_ids) + 1  # the final EOS's too
    for token, entry in zip([*reply_ids, EOS], content, strict=True):
        expected = list(dict.fromkeys([token, *chosen]))
        assert [t["token"] for t in entry["top_logprobs"]] == [
            tokenizer.decode([t]) for t in expected
        ]
    status, body = await post(
        frontend,
        "/v1/completions",
        {"prompt": "Say hello", "logprobs": 0, "logprob_token_ids": chosen},
    )
    assert status == 200, body
    first = body["choices"][0]["logprobs"]["top_logprobs"][0]
    assert list(first) == [tokenizer.decode([t]) for t in dict.fromkeys([reply_ids[0], *chosen])]


@pytest.mark.parametrize(
    "path,fields",
    [
        ("/v1/chat/completions", {"logprob_token_ids": [5]}),
        ("/v1/chat/completions", {"logprobs": False, "logprob_token_ids": [5]}),
        ("/v1/completions", {"logprob_token_ids": [5]}),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": list(range(129))}),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [10**7]}),
    ],
)
async def test_logprob_token_ids_vllm_refuses_are_a_400(
    frontend: Frontend, path: str, fields: dict[str, Any]
) -> None:
    body: dict[str, Any] = {**fields}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Say hello"
    status, reply = await post(frontend, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == "logprob_token_ids"


# ---------------------------------------------------------------------- thinking budget


@pytest.mark.parametrize("budget,sent", [(8, 8), (0, 0), (-1, None), (None, None)])
def test_a_thinking_token_budget_goes_to_the_worker_as_vllm_reads_it(
    preprocessor: Preprocessor, budget: int | None, sent: int | None
) -> None:
    """-1 is vLLM's "unlimited" (no budget); the worker's engine applies the rest, or
    refuses it without a reasoning config."""
    prepared = preprocessor.prepare_chat_sync(chat_request(thinking_token_budget=budget), "r")
    assert prepared.request.sampling_options.thinking_token_budget == sent


def test_a_thinking_token_budget_below_minus_one_is_a_400(preprocessor: Preprocessor) -> None:
    request = chat_request(thinking_token_budget=-2)
    error = openai_error_of(lambda: preprocessor.prepare_chat_sync(request, "r"))
    assert error.status == 400 and error.param == "thinking_token_budget"
