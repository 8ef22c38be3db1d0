"""`python -m dynamo.frontend` in front of real vLLM workers, driven by the official
`openai` client.

Claims: completions and chat work streaming and non-streaming with correct usage
(`stream_options.include_usage` included) and greedy output is sensible ("Tokyo"); a
stream is the same text as the non-streamed response; stop strings end the response
without leaking and cancel the work on the worker; a client that goes away mid-request
cancels it on the worker; vLLM's token fields (`truncate_prompt_tokens`,
`return_token_ids`, `include_stop_str_in_output`, `prompt_logprobs`, `echo` with
`logprobs`) act on the real engine's tokens; bad
input gets OpenAI-shaped 4xx JSON; `/metrics` is free of
`_created` noise; seeded requests whose prefills vLLM splits over steps (four long prompts
at once, more than a step's token budget) are served and leave the engine serving (they
used to kill a CPU engine: `CPU Generator does not use offset`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from e2e_prompts import chat_ids

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.http import http_get
from dynamo.testing.processes import FrontendProcess, WorkerProcess
from dynamo.testing.waiting import wait_until

MODEL = DEFAULT_MODEL
CONTEXT_LENGTH = 2048  # --max-model-len of the session workers
IN_FLIGHT = "dynamo_worker_requests_in_flight"
# Long enough that a request still runs when the client goes away (~40 tokens/s on CPU).
LONG_MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def client(frontend: FrontendProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def workers(ngram_worker: WorkerProcess, plain_worker: WorkerProcess) -> list[WorkerProcess]:
    return [ngram_worker, plain_worker]


def in_flight(workers: list[WorkerProcess]) -> float:
    """Requests being generated on any worker the frontend may have routed to."""
    return sum(w.metric(IN_FLIGHT) for w in workers)


def wait_until_idle(workers: list[WorkerProcess], timeout: float = 15.0) -> float:
    """Seconds until no worker has a request in flight; fails after `timeout`."""
    return wait_until(
        lambda: in_flight(workers) <= 0,
        timeout=timeout,
        interval=0.05,
        what=lambda: f"the workers to go idle ({in_flight(workers):g} requests in flight)",
    )


def chat_prompt_tokens(tokenizer, content: str) -> int:
    return len(chat_ids(tokenizer, content))


# --------------------------------------------------------------------------- happy paths


def test_models_and_health(frontend: FrontendProcess, client: openai.OpenAI) -> None:
    assert MODEL in [m.id for m in client.models.list().data]
    assert client.models.retrieve(MODEL).id == MODEL
    status, body = http_get(f"{frontend.base_url}/health")
    assert status == 200
    health = json.loads(body)
    assert health["status"] == "healthy"
    assert health["models"][MODEL]["instances"]


def test_chat_greedy_answer_and_usage(client: openai.OpenAI, tokenizer) -> None:
    question = "What is the capital of Japan?"
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=32,
    )
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert "Tokyo" in choice.message.content
    assert choice.finish_reason == "stop"  # the model ends its answer with EOS
    assert "<|im_end|>" not in choice.message.content  # the EOS text is not part of it
    usage = resp.usage
    assert usage.prompt_tokens == chat_prompt_tokens(tokenizer, question)
    assert 0 < usage.completion_tokens < 32
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_equals_unary_with_usage_chunk(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to ten in words."}],
        temperature=0,
        max_tokens=24,
    )
    # Warm the prefix cache first so the unary and streamed requests below split the
    # prompt identically (cached whole blocks + computed tail): same shapes, same bf16
    # rounding, so any difference in text is the frontend's, not the arithmetic's.
    client.chat.completions.create(**{**kwargs, "max_tokens": 1})
    unary = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *content_chunks, usage_chunk = chunks
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == unary.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in content_chunks]
    assert finishes[-1] == unary.choices[0].finish_reason == "length"
    assert all(f is None for f in finishes[:-1])
    # The usage chunk comes last, with no choices, and only there.
    assert usage_chunk.choices == []
    usage = usage_chunk.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        unary.usage.prompt_tokens,
        24,
        unary.usage.prompt_tokens + 24,
    )
    # The same prompt was just served: its first full KV block came from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert (
        usage.prompt_tokens_details.cached_tokens == unary.usage.prompt_tokens_details.cached_tokens
    )
    assert all(c.usage is None for c in content_chunks)


def test_completions_unary_and_stream(client: openai.OpenAI, tokenizer) -> None:
    prompt = "The capital of France is"
    unary = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    assert unary.object == "text_completion"
    assert unary.id.startswith("cmpl-")
    text = unary.choices[0].text
    assert "Paris" in text
    assert unary.choices[0].finish_reason == "length"
    assert unary.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert unary.usage.completion_tokens == 12

    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    # Without stream_options.include_usage there is no usage chunk.
    assert all(c.choices and c.usage is None for c in chunks)

    with_usage = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].choices == []
    assert with_usage[-1].usage.prompt_tokens == unary.usage.prompt_tokens
    assert with_usage[-1].usage.completion_tokens == 12


async def test_concurrent_streams_all_complete(frontend: FrontendProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Request number {i}: write a short poem about the sea.",
            max_tokens=20,
            temperature=0.8,
            seed=i,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
        text, tokens = "", -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens

    try:
        results = await asyncio.gather(*(one(i) for i in range(8)))
    finally:
        await client.close()
    assert [tokens for _, tokens in results] == [20] * 8
    assert all(text for text, _ in results)


# --------------------------------------------------------------------------- stop strings


def test_stop_string_ends_response_without_leaking(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        prompt="Once upon a time, in a small village near Paris, there lived a cat named",
        temperature=0,
        max_tokens=48,
        extra_body={"ignore_eos": True},  # always 48 tokens of text to pick a stop from
    )
    baseline = client.completions.create(**kwargs).choices[0].text
    # A word from the later part of the greedy output: the stop string is met there (or
    # at an earlier occurrence), usually across a token boundary.
    words = re.findall(r"[A-Za-z]{4,}", baseline[len(baseline) // 3 :])
    assert words, f"no usable stop word in {baseline!r}"
    stop = words[0]
    expected = baseline[: baseline.index(stop)]

    unary = client.completions.create(**kwargs, stop=["@@never@@", stop])
    assert unary.choices[0].text == expected
    assert unary.choices[0].finish_reason == "stop"
    assert unary.usage.completion_tokens < 48

    chunks = list(client.completions.create(**kwargs, stop=stop, stream=True))
    streamed = [c.choices[0].text for c in chunks]
    assert "".join(streamed) == expected
    assert not any(stop in piece for piece in streamed)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllm_token_fields_with_a_real_engine(client: openai.OpenAI, tokenizer) -> None:
    """vLLM's `truncate_prompt_tokens`, `return_token_ids` and `include_stop_str_in_output`
    through the frontend and a real worker: a prompt longer than the context is served
    from its last 16 tokens, the ids returned are the ones the engine generated (they
    decode to the text; a chat's EOS comes last), and an included stop string ends the
    greedy text right after it."""
    long_text = "Tell me a story. " + "hello " * (CONTEXT_LENGTH + 100)
    resp = client.completions.create(
        model=MODEL,
        prompt=long_text,
        temperature=0,
        max_tokens=4,
        extra_body={"truncate_prompt_tokens": 16, "return_token_ids": True},
    )
    choice = resp.choices[0]
    assert resp.usage.prompt_tokens == 16
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode(long_text)[-16:]
    assert decoded(tokenizer, choice.model_extra["token_ids"]) == choice.text

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of Japan?"}],
        temperature=0,
        max_tokens=32,
        extra_body={"return_token_ids": True},
    )
    ids = chat.choices[0].model_extra["token_ids"]
    assert chat.choices[0].finish_reason == "stop" and ids[-1] == tokenizer.eos_token_id
    assert decoded(tokenizer, ids[:-1]) == chat.choices[0].message.content
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens

    kwargs = dict(
        model=MODEL,
        prompt="Once upon a time, in a small village near Paris, there lived a cat named",
        temperature=0,
        max_tokens=32,
        extra_body={"ignore_eos": True},
    )
    baseline = client.completions.create(**kwargs).choices[0].text
    words = re.findall(r"[A-Za-z]{4,}", baseline[len(baseline) // 3 :])
    assert words, f"no usable stop word in {baseline!r}"
    stop = words[0]
    kwargs["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    included = client.completions.create(**kwargs, stop=[stop]).choices[0]
    # The text ends with the stop's first occurrence (whichever worker answered: the two
    # session workers may part at a bf16 near-tie, so the baseline is only the source of
    # the word, as in the test below).
    assert included.finish_reason == "stop"
    assert included.text.index(stop) == len(included.text) - len(stop), included.text


def test_prompt_logprobs_and_echoed_logprobs_with_a_real_engine(
    client: openai.OpenAI, tokenizer
) -> None:
    """vLLM's `prompt_logprobs` from the engine: one entry per prompt token (null first),
    the prompt's own token first with its rank, then the best alternative; with `echo` and
    `logprobs`, the prompt's tokens lead `logprobs` with the same values."""
    prompt = "The capital of Japan is Tokyo, and the capital of France is"
    ids = tokenizer.encode(prompt)
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=2,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 1},
    )
    choice = resp.choices[0]
    positions = choice.model_extra["prompt_logprobs"]
    assert len(positions) == len(ids) == resp.usage.prompt_tokens and positions[0] is None
    for token, position in zip(ids[1:], positions[1:], strict=True):
        own = position[str(token)]
        assert next(iter(position)) == str(token) and own["rank"] >= 1
        assert own["decoded_token"] == tokenizer.decode([token])
        best = min(position.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and best["logprob"] >= own["logprob"]
    logprobs = choice.logprobs
    assert logprobs.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None
    prompt_values = [p[str(t)]["logprob"] for t, p in zip(ids[1:], positions[1:], strict=True)]
    assert logprobs.token_logprobs[1 : len(ids)] == prompt_values
    assert choice.text.startswith(prompt)


def decoded(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def test_stop_string_cancels_the_worker_request(
    client: openai.OpenAI, workers: list[WorkerProcess]
) -> None:
    """A stop string met early ends the request on the worker too: the response returns
    long before LONG_MAX_TOKENS tokens could be generated, and no work is left behind."""
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    baseline = (
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
        .choices[0]
        .message.content
    )
    stop = baseline.strip()[:3]
    started = time.monotonic()
    resp = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=LONG_MAX_TOKENS,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert stop not in resp.choices[0].message.content
    assert resp.usage.completion_tokens < 16
    assert time.monotonic() - started < 10
    wait_until_idle(workers)


# --------------------------------------------------------------------------- cancellation


def test_client_disconnect_mid_stream_cancels_on_worker(
    frontend: FrontendProcess, workers: list[WorkerProcess]
) -> None:
    wait_until_idle(workers)
    disconnects = frontend.metric("dynamo_frontend_client_disconnects_total")
    closed = frontend.metric("dynamo_frontend_requests_total", status="499")
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": LONG_MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    seen_busy = False
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{frontend.base_url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        events = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events += 1
                assert line != "data: [DONE]", "the request ended before the disconnect"
            if events >= 5 and not seen_busy:
                seen_busy = in_flight(workers) >= 1
            if seen_busy and events >= 10:
                break  # leaving both `with` blocks closes the connection
    assert seen_busy, "the request never showed up as in flight on a worker"
    wait_until_idle(workers)
    wait_until(
        lambda: frontend.metric("dynamo_frontend_inflight_requests") <= 0,
        timeout=5,
        interval=0.05,
        what="the frontend to stop counting the request in flight",
    )
    assert frontend.metric("dynamo_frontend_client_disconnects_total") == disconnects + 1
    assert frontend.metric("dynamo_frontend_requests_total", status="499") == closed + 1


def test_client_timeout_on_unary_request_cancels_on_worker(
    frontend: FrontendProcess, workers: list[WorkerProcess]
) -> None:
    """A non-streaming client that gives up (read timeout) cancels the work as well."""
    wait_until_idle(workers)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": LONG_MAX_TOKENS,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=httpx.Timeout(30, read=2.0)) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post(f"{frontend.base_url}/v1/chat/completions", json=body)
    # The request ran on a worker when the client gave up, then stopped there.
    assert wait_until_idle(workers) < 15


# --------------------------------------------------------------------------- bad input


STEP_TOKEN_BUDGET = 2048  # max_num_batched_tokens of the n-gram worker (vLLM's default)


def test_seeded_requests_with_chunked_prefills_leave_the_engine_serving(
    client: openai.OpenAI, frontend: FrontendProcess, tokenizer
) -> None:
    """Four ~1,800-token prompts at once do not fit one step's budget, so vLLM splits
    their prefills over steps and discards the samples of the unfinished ones; for a
    seeded request it then rewinds the generator, which a CPU generator cannot do."""
    prompts = [
        f"Chapter {i}. " + "The history of knitting in many lands and many hands. " * 160
        for i in range(4)
    ]
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert all(1500 < n < CONTEXT_LENGTH - 16 for n in lengths), lengths
    assert sum(lengths) > 2 * STEP_TOKEN_BUDGET, "the prefills must be split over steps"

    def complete(i: int) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0.8, seed=7 + i
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(complete, range(len(prompts))))
    assert [r.usage.completion_tokens for r in results] == [8] * len(prompts)
    # The engine lives: the model is still served, a plain request too.
    assert http_get(f"{frontend.base_url}/health")[0] == 200
    after = client.completions.create(model=MODEL, prompt="The capital of Japan is", max_tokens=4)
    assert after.usage.completion_tokens == 4


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )


def test_prompt_longer_than_context_is_400(client: openai.OpenAI) -> None:
    long_text = "hello " * (CONTEXT_LENGTH + 100)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=long_text, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=4
        )
    assert info.value.body["param"] == "messages"
    # A prompt that fits, with max_tokens that do not.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=CONTEXT_LENGTH)
    assert info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "max_tokens"


def test_n_beyond_the_cap_is_400(client: openai.OpenAI) -> None:
    """n is served from 1 to 16 (docs/frontend.md, "Several choices"); more is a 400."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=17)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=17
        )


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x " * 3000}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 9}, 400, "temperature"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ],
)
def test_errors_have_openai_shape(
    frontend: FrontendProcess, path: str, body: dict, status: int, param: str
) -> None:
    resp = httpx.post(f"{frontend.base_url}{path}", json=body, timeout=30)
    assert resp.status_code == status
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_body_that_is_not_json_is_400(frontend: FrontendProcess) -> None:
    resp = httpx.post(
        f"{frontend.base_url}/v1/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_json"


# --------------------------------------------------------------------------- metrics


def test_metrics_count_requests_without_created_series(
    frontend: FrontendProcess, client: openai.OpenAI
) -> None:
    before = frontend.metric("dynamo_frontend_requests_total", endpoint="completions", status="200")
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    status, text = http_get(f"{frontend.base_url}/metrics")
    assert status == 200
    after = frontend.metric("dynamo_frontend_requests_total", endpoint="completions", status="200")
    assert after == before + 1
    assert frontend.metric("dynamo_frontend_output_tokens_total") > 0
    assert "dynamo_frontend_time_to_first_token_seconds_count" in text
    created = [line for line in text.splitlines() if "_created" in line]
    assert created == []
