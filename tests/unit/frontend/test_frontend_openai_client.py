"""The official `openai` Python client against the frontend (scripted in-memory engine):
what real applications will do."""

from __future__ import annotations

import openai
import pytest
from frontend_support import MODEL, Frontend, Script

REPLY = "Hello there, friend."


async def test_completion(client: openai.AsyncOpenAI, frontend: Frontend) -> None:
    result = await client.completions.create(model=MODEL, prompt="Say hello", max_tokens=50)
    assert result.choices[0].text == REPLY
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None
    prompt_tokens = len(frontend.client.requests[-1].token_ids)
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == len(frontend.engine.reply_ids()) + 1
    assert result.usage.total_tokens == prompt_tokens + result.usage.completion_tokens


async def test_chat_completion(client: openai.AsyncOpenAI) -> None:
    result = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        temperature=0.0,
        seed=1,
    )
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == REPLY
    assert result.usage is not None and result.usage.completion_tokens > 0


async def test_streaming_chat_with_usage(client: openai.AsyncOpenAI, frontend: Frontend) -> None:
    frontend.engine.script = Script(reply=REPLY, steps=(1, 2), delay=0.002, cached_tokens=3)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(texts) == REPLY
    assert finish == "stop"
    assert usage is not None
    assert usage.completion_tokens == len(frontend.engine.reply_ids()) + 1
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3


async def test_streaming_completion_with_stop(
    client: openai.AsyncOpenAI, frontend: Frontend
) -> None:
    frontend.engine.script = Script(reply=REPLY, delay=0.002)
    stream = await client.completions.create(
        model=MODEL, prompt="Say hello", stream=True, stop=[", fr"]
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == "Hello there"
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_models_list(client: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in client.models.list()]
    assert models == [MODEL]


async def test_errors_raise_the_typed_exceptions(
    client: openai.AsyncOpenAI, frontend: Frontend
) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.completions.create(model="missing", prompt="x")
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as bad_n:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=17
        )
    assert bad_n.value.param == "n"
    await frontend.client.close()
    with pytest.raises(openai.InternalServerError) as unavailable:
        await client.completions.create(model=MODEL, prompt="x")
    assert unavailable.value.status_code == 503


async def test_mid_stream_engine_error_raises_in_the_client(
    client: openai.AsyncOpenAI, frontend: Frontend
) -> None:
    frontend.engine.script = Script(reply=REPLY, delay=0.002, fail_after=2)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    with pytest.raises(openai.APIError, match="scripted failure"):
        async for _ in stream:
            pass
