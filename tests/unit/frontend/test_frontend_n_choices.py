"""`n` > 1 through the HTTP frontend: one engine request, n choices.

The engine here interleaves the outputs of n sequences on one stream, each naming its
sequence by `index`, as a vLLM worker does with parallel sampling: a scripted engine where
the text of each choice must be exact (stop strings, finish reasons, usage), and the
mocker's engine in process for n independent sampled streams.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest
from frontend_support import EOS, MODEL, output_plan, parse_sse, start_frontend

from dynamo.frontend.engine.disagg import DisaggregatedEngineClient
from dynamo.frontend.engine.errors import EngineFailedError
from dynamo.frontend.engine.prefill_policy import DisaggSettings, PrefillMode, PrefillReason
from dynamo.frontend.engine.request_legs import RequestLegs
from dynamo.frontend.http.server import HttpService
from dynamo.frontend.openai.protocol import Usage
from dynamo.frontend.parsing.chat_output import ChatPieces, PlainText
from dynamo.frontend.postprocess.chat_formatter import ChatFormatter
from dynamo.frontend.postprocess.postprocessor import TextDelta
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    decode,
    encode,
)
from dynamo.mocker import MockEngine, MockEngineConfig, TimingModel
from dynamo.runtime import InstanceGoneError
from dynamo.testing.engines import InMemoryEngineClient

Handler = Callable[[PreprocessedRequest], AsyncGenerator[LLMEngineOutput, None]]


@dataclass(frozen=True)
class Choice:
    """What the scripted engine sends for one sequence."""

    text: str
    finish: FinishReason = FinishReason.EOS


CHOICES = (
    Choice("The sky is blue today."),
    Choice("Once upon a time END there was more.", FinishReason.LENGTH),
    Choice("A short one."),
)


def interleaved(tokenizer: Any, choices: tuple[Choice, ...] = CHOICES) -> Handler:
    """An engine answering any request with `choices`, one token per output, round robin
    over the sequences (each output tagged with its `index`), each sequence ending with
    its own finish reason and usage, as a vLLM worker streams parallel sampling."""

    def ids_of(choice: Choice) -> list[int]:
        ids = tokenizer.backend_tokenizer.encode(choice.text, add_special_tokens=False).ids
        return [*ids, EOS] if choice.finish is FinishReason.EOS else ids

    async def handler(request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        n = request.sampling_options.n or 1
        streams = [ids_of(choice) for choice in choices[:n]]
        prompt = len(request.token_ids)
        for step in range(max(len(ids) for ids in streams)):
            for index, ids in enumerate(streams):
                if step >= len(ids):
                    continue
                out = LLMEngineOutput(token_ids=[ids[step]], index=index)
                if step == len(ids) - 1:
                    out.finish_reason = choices[index].finish
                    out.completion_usage = CompletionUsage(prompt, len(ids), prompt + len(ids))
                yield out

    return handler


@dataclass
class Running:
    service: HttpService
    client: InMemoryEngineClient

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.post(self.service.url + path, json=body) as resp:
                raw = await resp.read()
                if resp.content_type == "application/json":
                    return resp.status, json.loads(raw)
                return resp.status, [json.loads(p) for p in parse_sse(raw) if p != "[DONE]"]


async def start(tokenizer: Any, handler: Handler) -> Running:
    frontend = await start_frontend(tokenizer, handler=handler)
    return Running(frontend.service, frontend.client)


@pytest.fixture
async def scripted(tokenizer: Any) -> AsyncIterator[Running]:
    running = await start(tokenizer, interleaved(tokenizer))
    try:
        yield running
    finally:
        await running.service.stop()


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 3}
COMPLETION_BODY = {"model": MODEL, "prompt": "Once upon a time", "n": 3}


def expected_usage(prompt_tokens: int) -> dict[str, int]:
    completion = 7 + 9 + 5  # the three scripted sequences' tokens, EOS included
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion}


async def test_chat_n3_gives_three_choices_from_one_engine_request(
    scripted: Running, tokenizer: Any
) -> None:
    status, body = await scripted.post(CHAT, CHAT_BODY)
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [c.text for c in CHOICES]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "stop"]
    # One request reached the engine, asking for three sequences (one placement).
    assert len(scripted.client.requests) == 1
    assert scripted.client.requests[0].sampling_options.n == 3
    usage = body["usage"]
    ids = [
        len(tokenizer.backend_tokenizer.encode(c.text, add_special_tokens=False).ids)
        + (c.finish is FinishReason.EOS)
        for c in CHOICES
    ]
    prompt = len(scripted.client.requests[0].token_ids)
    assert usage["prompt_tokens"] == prompt  # the prompt once, not three times
    assert usage["completion_tokens"] == sum(ids)
    assert usage["total_tokens"] == prompt + sum(ids)


async def test_streamed_chunks_carry_their_choice_and_each_choice_finishes(
    scripted: Running,
) -> None:
    body = {**COMPLETION_BODY, "stream": True, "stream_options": {"include_usage": True}}
    status, chunks = await scripted.post(COMPLETIONS, body)
    assert status == 200, chunks
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1 and chunk.get("usage") is None
        choice = chunk["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == {i: c.text for i, c in enumerate(CHOICES)}
    assert finishes == {0: ["stop"], 1: ["length"], 2: ["stop"]}  # one finish each
    final = chunks[-1]
    assert final["choices"] == []
    total = final["usage"]
    assert total["completion_tokens"] == total["total_tokens"] - total["prompt_tokens"]
    assert total["prompt_tokens"] == len(scripted.client.requests[0].token_ids)
    unary_status, unary = await scripted.post(COMPLETIONS, COMPLETION_BODY)
    assert unary_status == 200 and unary["usage"] == total


async def test_streamed_chat_sends_the_role_once_per_choice(scripted: Running) -> None:
    status, chunks = await scripted.post(CHAT, {**CHAT_BODY, "stream": True})
    assert status == 200, chunks
    roles = [
        (c["choices"][0]["index"], c["choices"][0]["delta"].get("role"))
        for c in chunks
        if c["choices"]
    ]
    assert sorted(i for i, role in roles if role == "assistant") == [0, 1, 2]
    content: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            content[choice["index"]] = content.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
    assert content == {i: c.text for i, c in enumerate(CHOICES)}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_ends_only_its_own_choice(scripted: Running, stream: bool) -> None:
    status, result = await scripted.post(
        COMPLETIONS, {**COMPLETION_BODY, "stop": ["END"], "stream": stream}
    )
    assert status == 200, result
    if stream:
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for chunk in result:
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
    else:
        texts = {c["index"]: c["text"] for c in result["choices"]}
        finish = {c["index"]: c["finish_reason"] for c in result["choices"]}
    assert texts == {0: CHOICES[0].text, 1: "Once upon a time ", 2: CHOICES[2].text}
    assert finish == {0: "stop", 1: "stop", 2: "stop"}


@pytest.mark.parametrize(
    "path,body",
    [
        (CHAT, {**CHAT_BODY, "n": 17}),
        (COMPLETIONS, {**COMPLETION_BODY, "n": 17}),
        (CHAT, {**CHAT_BODY, "n": 0}),
        (COMPLETIONS, {**COMPLETION_BODY, "n": -1}),
    ],
    ids=["chat-17", "completions-17", "chat-0", "completions-negative"],
)
async def test_n_outside_1_to_16_is_a_400_naming_n(
    scripted: Running, path: str, body: dict[str, Any]
) -> None:
    status, result = await scripted.post(path, body)
    assert status == 400, result
    assert result["error"]["param"] == "n"
    assert scripted.client.requests == []


async def test_best_of_is_refused_naming_the_v1_engine(scripted: Running) -> None:
    status, result = await scripted.post(COMPLETIONS, {**COMPLETION_BODY, "best_of": 3})
    assert status == 400, result
    assert result["error"]["param"] == "best_of"
    assert "V1 engine" in result["error"]["message"]


# ---------------------------------------------------------------------- with the mocker


@pytest.fixture
async def mocked(tokenizer: Any) -> AsyncIterator[Running]:
    """The frontend over the mocker's engine, in process (its vocabulary is the tiny
    tokenizer's, so every sampled id decodes)."""
    config = MockEngineConfig(
        block_size=32,
        num_gpu_blocks=256,
        max_model_len=256,
        timing=TimingModel(speed_up=1e6),
        vocab_size=len(tokenizer),
        eos_token_ids=(EOS,),
        special_token_ids=frozenset(tokenizer.all_special_ids),
        eos_probability=0.0,
    )
    engine = await MockEngine(config).start()
    running = await start(tokenizer, engine.generate)
    try:
        yield running
    finally:
        await running.service.stop()
        await engine.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_mocker_samples_n_independent_choices(mocked: Running, stream: bool) -> None:
    body = {
        **CHAT_BODY,
        "max_tokens": 6,
        "logprobs": True,
        "seed": 5,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    status, result = await mocked.post(CHAT, body)
    assert status == 200, result
    if stream:
        content: dict[int, str] = {}
        logprobs: dict[int, int] = {}
        finish: dict[int, str] = {}
        for chunk in result:
            for choice in chunk["choices"]:
                index = choice["index"]
                content[index] = content.get(index, "") + (choice["delta"].get("content") or "")
                logprobs[index] = logprobs.get(index, 0) + len(
                    (choice.get("logprobs") or {}).get("content") or []
                )
                if choice["finish_reason"]:
                    finish[index] = choice["finish_reason"]
        usage = result[-1]["usage"]
    else:
        content = {c["index"]: c["message"]["content"] for c in result["choices"]}
        logprobs = {c["index"]: len(c["logprobs"]["content"]) for c in result["choices"]}
        finish = {c["index"]: c["finish_reason"] for c in result["choices"]}
        usage = result["usage"]
    assert sorted(content) == [0, 1, 2]
    assert len(set(content.values())) == 3, content  # independent sequences
    assert logprobs == {0: 6, 1: 6, 2: 6}  # logprobs per choice
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage["completion_tokens"] == 18
    assert len(mocked.client.requests) == 1


# ---------------------------------------------------------------------- migration


def test_a_lost_worker_migrates_one_sequence_but_fails_n_sequences() -> None:
    """A migration continues one sequence from the tokens streamed so far; the tokens of n
    interleaved sequences cannot be one continuation prompt, so n > 1 fails instead."""
    single = PreprocessedRequest(request_id="r1", model=MODEL, token_ids=[5, 6])
    parallel = msgspec.structs.replace(
        single, request_id="r3", sampling_options=SamplingOptions(n=3, temperature=0.8)
    )
    lost = InstanceGoneError(1)
    one = RequestLegs(single, migration_limit=2)
    one.record(LLMEngineOutput(token_ids=[7]), 0)
    assert one.lost_on(1, lost) is True  # migrated
    three = RequestLegs(parallel, migration_limit=2)
    three.record(LLMEngineOutput(token_ids=[7], index=1), 0)
    with pytest.raises(EngineFailedError):
        three.lost_on(1, lost)


async def test_disaggregated_n3_skips_the_prefill_worker() -> None:
    """vLLM's n children would each try to load the one transferred KV: the decode worker
    prefills once for them instead, and the prefill worker is not asked."""

    async def prefill_handler(req: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        yield LLMEngineOutput(finish_reason=FinishReason.LENGTH, disaggregated_params={"x": 1})

    async def decode_handler(req: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        for index in range(req.sampling_options.n or 1):
            yield LLMEngineOutput(token_ids=[9], index=index, finish_reason=FinishReason.EOS)

    prefill = InMemoryEngineClient(prefill_handler)
    decode = InMemoryEngineClient(decode_handler)
    always_remote = DisaggSettings(mode=PrefillMode.REMOTE)
    client = DisaggregatedEngineClient(prefill, decode, settings=always_remote)
    request = PreprocessedRequest(
        request_id="r3", model=MODEL, token_ids=[5, 6], sampling_options=SamplingOptions(n=3)
    )
    outputs = [o async for o in client.generate(request)]
    assert [o.index for o in outputs] == [0, 1, 2]
    assert prefill.requests == []
    (decoded,) = decode.requests
    assert decoded.prefill_result is None and decoded.sampling_options.n == 3
    assert client.decisions == {PrefillReason.MULTIPLE_CHOICES: 1}


# ---------------------------------------------------------------------- formatter and wire


class Recording(PlainText):
    """A plain-text parser that records the text it was fed (one per choice)."""

    def __init__(self) -> None:
        self.fed: list[str] = []

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        self.fed.append(text)
        return super().feed(text, token_ids)


def test_each_chat_choice_gets_its_own_parser_from_the_factory() -> None:
    plan = output_plan()
    made: list[Recording] = []

    def factory() -> Recording:
        made.append(Recording())
        return made[-1]

    formatter = ChatFormatter("id", MODEL, plan, parser_factory=factory)
    for index, text in [(1, "b"), (0, "a"), (1, "c"), (0, "d"), (2, "e")]:
        formatter.add(TextDelta(text=text, index=index))
    for index in range(3):
        formatter.add(TextDelta(index=index, finish_reason="stop"))
    body = json.loads(formatter.body(Usage(1, 5, 6)))
    assert [c["message"]["content"] for c in body["choices"]] == ["ad", "bc", "e"]
    assert sorted(r.fed for r in made) == [["a", "d"], ["b", "c"], ["e"]]  # one per choice


def test_the_choice_index_is_optional_on_the_wire() -> None:
    """An old worker's outputs carry no `index`: choice 0; an old worker ignores `n`."""
    old = msgspec.msgpack.encode({"token_ids": [1, 2], "finish_reason": "eos"})
    assert decode(old, LLMEngineOutput).index == 0
    assert "index" not in msgspec.to_builtins(LLMEngineOutput(token_ids=[1]))
    new = decode(encode(LLMEngineOutput(token_ids=[1], index=2)), LLMEngineOutput)
    assert new.index == 2
    assert decode(encode(SamplingOptions(n=3)), SamplingOptions).n == 3


class AllReasoning(PlainText):
    """A parser that files every piece of text as reasoning (a reply cut off inside
    `<think>`)."""

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        return ChatPieces(reasoning=text)


def test_a_message_of_only_reasoning_has_null_content_as_vllm_sends_it() -> None:
    plan = output_plan()
    formatter = ChatFormatter("id", MODEL, plan, parser_factory=AllReasoning)
    formatter.add(TextDelta(text="hmm", finish_reason="length"))
    (choice,) = json.loads(formatter.body(Usage(1, 1, 2)))["choices"]
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "hmm"
    plain = ChatFormatter("id", MODEL, plan)
    plain.add(TextDelta(text="", finish_reason="length"))
    (choice,) = json.loads(plain.body(Usage(1, 0, 1)))["choices"]
    assert choice["message"]["content"] == "", "no parser, no text: an empty string"
