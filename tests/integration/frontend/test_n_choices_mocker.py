"""`n` > 1 end to end without vLLM: the real frontend (in this process, KV router) and a
mocker worker over a real nats-server, through the official `openai` client.

Claims:
* `n=3` gives three choices with indices 0..2, three different texts, each with its own
  finish reason; usage counts the prompt once and sums the completions;
* streamed, every chunk names its choice, each choice ends with exactly one finish-reason
  chunk, the texts are those of the non-streaming response (seeded), and the usage chunk
  carries the same sum;
* the sequences' outputs cross NATS with their `index` (msgpack wire), and the worker ran
  the request as three sequences while the router placed and booked it once.
"""

from __future__ import annotations

import aiohttp
import openai

from dynamo.frontend.engine.routing import RouterMode
from dynamo.llm.worker import ServedWorker
from dynamo.mocker.backend import MockerBackend
from dynamo.testing.chat_bodies import chat_body
from dynamo.testing.mocker_clusters import openai_client_fixture, served_mocker_fixture

MODEL = "mock-n"
MAX_TOKENS = 8

# Every sequence runs to max_tokens.
served = served_mocker_fixture(MODEL, router_mode=RouterMode.KV, eos_probability=0.0)
client = openai_client_fixture()


REQUEST = chat_body(
    MODEL, "Name three colours of the sea.", n=3, temperature=0.8, seed=11, max_tokens=MAX_TOKENS
)


async def routed_requests(base_url: str) -> int:
    """How many requests the model's KV router has placed (its `/debug/kv` tally)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url + "/debug/kv") as resp:
            state = await resp.json()
    (router,) = state["models"][MODEL].values()
    return router["routing"]["requests"]


async def test_n3_chat_streaming_and_not(
    client: openai.AsyncOpenAI, served: tuple[str, ServedWorker[MockerBackend]]
) -> None:
    engine = served[1].backend.engine
    sequences_before = engine.counters.requests
    routed_before = await routed_requests(served[0])
    unary = await client.chat.completions.create(**REQUEST)
    assert engine.counters.requests - sequences_before == 3, "one request, three sequences"
    assert await routed_requests(served[0]) - routed_before == 1, "placed once"
    assert [c.index for c in unary.choices] == [0, 1, 2]
    assert [c.finish_reason for c in unary.choices] == ["length"] * 3
    texts = [c.message.content or "" for c in unary.choices]
    assert len(set(texts)) == 3, texts
    usage = unary.usage
    assert usage is not None and usage.completion_tokens == 3 * MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + 3 * MAX_TOKENS

    streamed: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    final_usage = None
    stream = await client.chat.completions.create(
        **REQUEST, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        final_usage = chunk.usage or final_usage
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert [streamed[i] for i in range(3)] == texts, "seeded: the same three texts"
    assert final_usage is not None and final_usage.completion_tokens == 3 * MAX_TOKENS
    assert final_usage.prompt_tokens == usage.prompt_tokens, "the prompt counted once"


async def test_n3_completions_logprobs_per_choice(client: openai.AsyncOpenAI) -> None:
    result = await client.completions.create(
        model=MODEL, prompt="The sea is", n=3, max_tokens=MAX_TOKENS, logprobs=2, seed=3
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    for choice in result.choices:
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert len(choice.logprobs.tokens) == MAX_TOKENS
        assert "".join(choice.logprobs.tokens) == choice.text
        offsets = choice.logprobs.text_offset or []
        assert offsets[0] == 0, "each choice's offsets start at its own text"
