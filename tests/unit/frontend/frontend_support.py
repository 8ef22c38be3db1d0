"""Test doubles for the frontend: a scripted in-process engine producing real token ids
from the tiny test tokenizer (`dynamo.testing.tokenizers`), a scripted stand-in for
`dynamo.runtime.Client`, request builders, and helpers to run a frontend on an ephemeral
port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import openai
import pytest

from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.server import HttpService
from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.models.manager import ModelManager
from dynamo.frontend.openai.errors import OpenAIError
from dynamo.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from dynamo.frontend.parsing.chat_parsers import ChatParsingOptions
from dynamo.frontend.preprocess.preprocessor import OutputPlan, Preprocessor
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    ModelCard,
    PreprocessedRequest,
    PromptTokensDetails,
    RankedLogprob,
    TokenLogprob,
    TopLogprob,
)
from dynamo.runtime import NoResponderError
from dynamo.testing.engines import InMemoryEngineClient
from dynamo.testing.tokenizers import EOS_TOKEN_ID

MODEL = "tiny-chat"
EOS = EOS_TOKEN_ID  # <|im_end|> in the tiny test tokenizer


def make_card(instance_id: int = 1, **overrides: Any) -> ModelCard:
    fields: dict[str, Any] = {
        "name": MODEL,
        "namespace": "dynamo",
        "component": "backend",
        "endpoint": "generate",
        "instance_id": instance_id,
        "context_length": 256,
        "kv_block_size": 32,
        "eos_token_ids": [EOS],
    }
    fields.update(overrides)
    return ModelCard(**fields)


def chat_request(**fields: Any) -> ChatCompletionRequest:
    """A decoded chat request as the HTTP layer hands it to the preprocessor: one user
    message to `MODEL` unless `fields` say otherwise."""
    fields.setdefault("model", MODEL)
    fields.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return msgspec.convert(fields, ChatCompletionRequest)


def completion_request(**fields: Any) -> CompletionRequest:
    """A decoded completion request with a short text prompt unless `fields` say otherwise."""
    fields.setdefault("model", MODEL)
    fields.setdefault("prompt", "Once upon a time")
    return msgspec.convert(fields, CompletionRequest)


def output_plan(**fields: Any) -> OutputPlan:
    """The preprocessor's plan for the output of a request: not streamed, no usage, no
    stop strings or hidden stop ids, special tokens skipped, no logprobs, unless `fields`
    say otherwise."""
    defaults: dict[str, Any] = {
        "stream": False,
        "include_usage": False,
        "stop_strings": (),
        "hidden_stop_ids": frozenset(),
        "skip_special_tokens": True,
        "logprobs": None,
    }
    return OutputPlan(**{**defaults, **fields})


@contextmanager
def replaced_render(tokenizer: Any, render: Callable[..., Any]) -> Iterator[None]:
    """`tokenizer.apply_chat_template` is `render` on this one object inside the block.

    Not `monkeypatch.setattr`: its undo sets the original *bound method* back as an
    attribute of the object, and a later `copy.copy` of the session's tokenizer (what
    `--chat-template` does) then carries a render bound to the original, with the
    original's template."""
    tokenizer.apply_chat_template = render
    try:
        yield
    finally:
        del tokenizer.apply_chat_template


def openai_error_of(call: Callable[[], object]) -> OpenAIError:
    """The `OpenAIError` that `call` raises (the test fails if it raises none), so a test
    can assert on its status, param and code."""
    with pytest.raises(OpenAIError) as info:
        call()
    return info.value


class FakeStream:
    """A response stream from one instance, scripted as a list of outputs and exceptions
    (an exception is raised when the stream reaches it)."""

    def __init__(
        self, instance_id: int, items: list[Any], on_no_responder: Callable[[int], None]
    ) -> None:
        self.instance_id = instance_id
        self._items: Iterator[Any] = iter(items)
        self._on_no_responder = on_no_responder
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        item = next(self._items, StopAsyncIteration())
        if isinstance(item, NoResponderError):
            self._on_no_responder(self.instance_id)  # as the real stream tells its client
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


class FakeClient:
    """Stands in for `dynamo.runtime.Client` under `RuntimeEngineClient`, recording what
    was sent where.

    Scripted two ways: `FakeClient(scripts, ids)` answers the n-th `direct` call with the
    n-th script whatever instance it goes to (the routable instances are `ids`);
    `FakeClient.per_instance({id: script})` answers each instance with its own script, for
    tests where which instance is picked decides the outcome.

    Like the real client, it pauses an instance whose stream answered "no responders"
    (`NoResponderError`): it leaves `routable_ids()` until `wait_routable` (which ends
    every pause at once and counts the waits) or until the test clears `paused`."""

    lease_ttl = 5.0

    def __init__(
        self,
        scripts: list[list[Any]],
        ids: list[int] | None = None,
        open_error: Exception | None = None,
    ) -> None:
        self._in_order = iter(scripts)
        self._by_instance: Mapping[int, list[Any]] | None = None
        self.ids = [1, 2] if ids is None else ids
        self.open_error = open_error  # raised by `direct` (e.g. a request that cannot be encoded)
        self.sent: list[tuple[str, int]] = []  # (request id, instance id) per `direct`
        self.requests: list[PreprocessedRequest] = []
        self.streams: list[FakeStream] = []
        self.options: list[dict[str, Any]] = []
        self.listeners: list[Callable[[list[int]], None]] = []
        self.closed = False
        self.paused: set[int] = set()
        self.waits = 0  # wait_routable calls

    @classmethod
    def per_instance(cls, scripts: Mapping[int, list[Any]]) -> FakeClient:
        client = cls([], ids=sorted(scripts))
        client._by_instance = scripts
        return client

    @property
    def sent_to(self) -> list[int]:
        """The instance each `direct` call went to, in order."""
        return [instance_id for _, instance_id in self.sent]

    def instance_ids(self) -> list[int]:
        return list(self.ids)

    def routable_ids(self) -> list[int]:
        return [i for i in self.ids if i not in self.paused]

    async def wait_routable(self, timeout: float, excluding: Collection[int] = ()) -> bool:
        self.waits += 1
        self.paused.clear()
        return any(i not in excluding for i in self.ids)

    def add_listener(self, listener: Callable[[list[int]], None]) -> None:
        self.listeners.append(listener)

    def direct(self, request: Any, instance_id: int, **kwargs: Any) -> FakeStream:
        assert instance_id in self.ids, "the router picks among the routable instances"
        assert kwargs["response_type"] is LLMEngineOutput
        if self.open_error is not None:
            raise self.open_error
        self.options.append(kwargs)
        self.requests.append(request)
        self.sent.append((kwargs["request_id"], instance_id))
        if self._by_instance is not None:
            script = list(self._by_instance[instance_id])
        else:
            script = next(self._in_order)
        stream = FakeStream(instance_id, script, self.paused.add)
        self.streams.append(stream)
        return stream

    async def close(self) -> None:
        self.closed = True


@dataclass
class Script:
    """What the scripted engine answers: `reply` tokenized with the real tokenizer, sent in
    steps of `steps` tokens (cycled; >1 mimics accepted speculative tokens)."""

    reply: str = "Hello there, friend."
    steps: Sequence[int] = (1,)
    delay: float = 0.0  # seconds between steps
    finish: FinishReason = FinishReason.EOS
    cached_tokens: int = 0
    fail_after: int | None = None  # steps before an error output
    raise_exc: BaseException | None = None  # raised before the first output
    raise_after: int | None = None  # steps before `raise_exc` is raised (None: at once)
    never_finish: bool = False  # keep producing until cancelled


@dataclass
class ScriptedEngine:
    """An `EngineClient` handler that behaves like a worker: real token ids, EOS appended,
    max_tokens honoured (finish `length`), usage on the last output."""

    tokenizer: Any
    script: Script = field(default_factory=Script)

    def reply_ids(self) -> list[int]:
        return self.tokenizer.backend_tokenizer.encode(
            self.script.reply, add_special_tokens=False
        ).ids

    async def __call__(self, request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        script = self.script
        if script.raise_exc is not None and script.raise_after is None:
            raise script.raise_exc
        ids = self.reply_ids()
        finish = script.finish
        if finish is FinishReason.EOS:
            ids = [*ids, EOS]
        limit = request.stop_conditions.max_tokens
        if limit is not None and len(ids) > limit:
            ids, finish = ids[:limit], FinishReason.LENGTH
        if script.never_finish:
            ids = ids * 1000
        sent = 0
        step_index = 0
        while sent < len(ids):
            if script.raise_after is not None and step_index >= script.raise_after:
                assert script.raise_exc is not None
                raise script.raise_exc
            if script.fail_after is not None and step_index >= script.fail_after:
                yield LLMEngineOutput(finish_reason=FinishReason.ERROR, error="scripted failure")
                return
            if script.delay:
                await asyncio.sleep(script.delay)
            size = script.steps[step_index % len(script.steps)]
            chunk = ids[sent : sent + size]
            sent += len(chunk)
            step_index += 1
            out = LLMEngineOutput(token_ids=chunk)
            options = request.output_options
            if options.logprobs is not None or options.logprob_token_ids:
                out.log_probs = [
                    _fake_logprob(t, options.logprobs or 0, options.logprob_token_ids)
                    for t in chunk
                ]
            prompt_top = request.output_options.prompt_logprobs
            if prompt_top is not None and step_index == 1:
                out.prompt_logprobs = fake_prompt_logprobs(request.token_ids, prompt_top)
            if sent >= len(ids) and not script.never_finish:
                out.finish_reason = finish
                out.completion_usage = CompletionUsage(
                    prompt_tokens=len(request.token_ids),
                    completion_tokens=len(ids),
                    total_tokens=len(request.token_ids) + len(ids),
                    prompt_tokens_details=PromptTokensDetails(cached_tokens=script.cached_tokens),
                )
            yield out


def fake_prompt_logprobs(prompt: Sequence[int], top: int) -> list[list[RankedLogprob] | None]:
    """vLLM's shape: None first, then the prompt token (logprob -0.5, rank 2) and `top`
    alternatives 100, 101, ... ranked 1, 3, 4, ... (so the prompt token is not the best)."""
    positions: list[list[RankedLogprob] | None] = [None]
    for token in prompt[1:]:
        ranked = [RankedLogprob(token, -0.5, 2)]
        ranked += [
            RankedLogprob(100 + i, -0.25 * (i + 1), 1 if i == 0 else i + 2) for i in range(top)
        ]
        positions.append(ranked)
    return positions


def _fake_logprob(token_id: int, top: int, chosen: Sequence[int] | None = None) -> TokenLogprob:
    """The sampled token at -0.25 and `top` alternatives 100, 101, ... (at least one); with
    `chosen` (vLLM's `logprob_token_ids`) those instead, at -1, -2, ..., listed worst first
    the way a worker would not (so their order in a response is the frontend's doing)."""
    if chosen:
        others = [TopLogprob(t, -1.0 - i) for i, t in enumerate(chosen) if t != token_id]
        alternatives = [TopLogprob(token_id, -0.25), *reversed(others)]
    else:
        alternatives = [TopLogprob(token_id, -0.25)] + [
            TopLogprob(100 + i, -1.0 - i) for i in range(max(top, 1))
        ]
    return TokenLogprob(token_id=token_id, logprob=-0.25, top=alternatives)


@dataclass
class Frontend:
    """A running frontend on 127.0.0.1:<ephemeral> with one scripted model."""

    service: HttpService
    manager: ModelManager
    engine: ScriptedEngine
    client: InMemoryEngineClient

    @property
    def url(self) -> str:
        return self.service.url


WORKER_WAIT_S = 0.3


async def start_frontend(
    tokenizer: Any,
    card: ModelCard | None = None,
    chat_parsing: ChatParsingOptions | None = None,
    *,
    engine: ScriptedEngine | None = None,
    handler: Any = None,
    **settings_kwargs: Any,
) -> Frontend:
    """A frontend over one scripted model; `settings_kwargs` are `HttpSettings` fields.
    The model's client calls `handler` when given (an engine of the test's own, wrapping
    `engine` or not), else `engine` (a new scripted engine unless given)."""
    card = card or make_card()
    engine = engine or ScriptedEngine(tokenizer)
    client = InMemoryEngineClient(handler or engine)
    manager = ModelManager(load_preprocessor=lambda c, _dir: Preprocessor(c, tokenizer))

    async def factory(_card: ModelCard) -> InMemoryEngineClient:
        return client

    await manager.add_instance(card, "/unused", factory)
    # A short wait for workers, so the tests that take the worker away get their 503 soon.
    settings_kwargs.setdefault("worker_wait_s", WORKER_WAIT_S)
    service = HttpService(
        manager,
        metrics=FrontendMetrics(),
        settings=HttpSettings(host="127.0.0.1", port=0, **settings_kwargs),
        chat_parsing=chat_parsing,
    )
    await service.start()
    return Frontend(service=service, manager=manager, engine=engine, client=client)


@asynccontextmanager
async def openai_client(frontend: Frontend) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official `openai` client of `frontend`, without retries."""
    async with openai.AsyncOpenAI(
        base_url=frontend.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


def parse_sse(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), "an SSE body ends with a blank line"
    events = text[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"not an SSE data event: {event!r}"
        payloads.append(event[len("data: ") :])
    return payloads
