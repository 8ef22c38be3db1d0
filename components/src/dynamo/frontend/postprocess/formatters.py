"""What every OpenAI response formatter shares: the `ResponseFormatter` interface the HTTP
layer drives, Server-Sent Events and JSON encoding, and the pieces the completion and chat
formatters both use (the chunk streams' ending, a choice's accumulated body, vLLM's
`prompt_logprobs`, and `ChoicesFormatter`, their common base).

A formatter serves one request. In streaming mode `events(delta)` gives the chunk(s) for a
delta, already encoded as Server-Sent Events; otherwise `add(delta)` accumulates and
`body(usage)` builds the final JSON. Encoding uses msgspec (a few microseconds per chunk),
because it runs once per streamed batch. The formatters themselves are
`completion_formatter.py`, `chat_formatter.py` and `responses_api.py`, one per API shape.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import msgspec

from dynamo.frontend.openai.errors import OpenAIError, error_event
from dynamo.frontend.openai.protocol import (
    PerRequestMetrics,
    PromptLogprob,
    PromptLogprobsField,
    Usage,
)
from dynamo.frontend.postprocess.postprocessor import PromptPosition, TextDelta, TokenLogprobs
from dynamo.frontend.preprocess.preprocessor import OutputPlan

SSE_DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def sse_event(obj: msgspec.Struct) -> bytes:
    """One Server-Sent Event carrying `obj` as JSON."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def encode_json(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


class ResponseFormatter(Protocol):
    """Builds one request's response, streaming or not."""

    def events(self, delta: TextDelta) -> bytes:
        """SSE bytes for `delta` (b"" when it adds nothing visible)."""
        ...

    def usage_event(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        """The final `choices: []` chunk carrying usage (stream_options.include_usage) and,
        beside it, the per-request `metrics` when there are any (as vLLM sends them)."""
        ...

    def add(self, delta: TextDelta) -> None:
        """Accumulate a delta for the non-streaming body."""
        ...

    def body(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        """The complete non-streaming response as JSON bytes (`metrics` beside usage)."""
        ...

    def failure_event(self, error: OpenAIError) -> bytes:
        """What reports `error` in a stream whose status line is already sent."""
        ...

    def end_of_stream(self) -> bytes:
        """What closes a stream after its last event."""
        ...


# vLLM writes -inf (a token the model rules out) as this, since JSON has no infinity.
MIN_LOGPROB = -9999.0


def prompt_logprobs_field(positions: list[PromptPosition]) -> PromptLogprobsField:
    """vLLM's `prompt_logprobs`: per position, token id -> logprob, rank and text."""
    return [
        None
        if position.ranked is None
        else {
            str(entry.token_id): PromptLogprob(
                logprob=max(entry.alternative.logprob, MIN_LOGPROB),
                rank=entry.rank,
                decoded_token=entry.alternative.token,
            )
            for entry in position.ranked
        }
        for position in positions
    ]


class ChunkStreamEnd:
    """The ending of the chat and completion APIs' streams: an in-band `{"error": ...}`
    event for a failure, and `data: [DONE]` last (the Responses API ends differently)."""

    def failure_event(self, error: OpenAIError) -> bytes:
        return error_event(error)

    def end_of_stream(self) -> bytes:
        return SSE_DONE


class ChoiceAccumulator:
    """Text, logprobs and finish reason gathered for a non-streaming response."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.generated_ids: list[int] = []  # filled only with `return_token_ids`
        self.finish_reason: str | None = None

    def add(self, delta: TextDelta) -> None:
        self.parts.append(delta.text)
        self.generated_ids.extend(delta.generated_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


ChoiceState = TypeVar("ChoiceState")
"""What a formatter keeps per choice between deltas."""
ResponseObject = TypeVar("ResponseObject", bound=msgspec.Struct)


@dataclass(eq=False)
class ChoicesFormatter(ChunkStreamEnd, ABC, Generic[ChoiceState]):
    """What the completion and chat formatters share: the response's identity (id, model,
    creation time) that each of its objects repeats, the output plan, one state per choice
    (`n` > 1: created on the choice's first delta) and the prompt's logprobs as they
    arrive. One base, so both APIs build their envelopes and choices the same way."""

    chunk_type: ClassVar[Callable[..., msgspec.Struct]]
    """The streamed object (`text_completion`, `chat.completion.chunk`)."""

    request_id: str
    model: str
    plan: OutputPlan
    created: int | None = None  # None (or 0): now
    _choices: dict[int, ChoiceState] = field(default_factory=dict, init=False)
    _prompt: list[PromptPosition] = field(default_factory=list, init=False)  # as they arrive

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def usage_event(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        return sse_event(self._response(self.chunk_type, [], usage, metrics))

    @abstractmethod
    def _new_choice(self, index: int) -> ChoiceState:
        """The state of choice `index`, at its first delta."""

    def _choice(self, index: int) -> ChoiceState:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = self._new_choice(index)
        return state

    def _body_indices(self) -> list[int]:
        """The choices of a non-streaming body: every one seen, or choice 0 of a response
        that produced nothing."""
        return sorted(self._choices) or [0]

    def _response(
        self,
        response_type: Callable[..., ResponseObject],
        choices: list[Any],
        usage: Usage | None = None,
        metrics: PerRequestMetrics | None = None,
        **fields: Any,
    ) -> ResponseObject:
        """A `response_type` object of this response around `choices`."""
        return response_type(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            metrics=metrics,
            **fields,
        )
