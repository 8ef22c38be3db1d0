"""OpenAI response objects from `TextDelta`s: the only module that knows the completion
and chat response shapes.

A formatter serves one request. In streaming mode `events(delta)` gives the chunk(s) for a
delta, already encoded as Server-Sent Events; otherwise `add(delta)` accumulates and
`body(usage)` builds the final JSON. Encoding uses msgspec (a few microseconds per chunk),
because it runs once per streamed batch.
"""

from __future__ import annotations

import time
from typing import Protocol

import msgspec

from dynamo.frontend.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PerRequestMetrics,
    Usage,
)
from dynamo.frontend.postprocessor import TextDelta, TokenLogprobs
from dynamo.frontend.preprocessor import OutputPlan

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


class _Accumulator:
    """Text, logprobs and finish reason gathered for a non-streaming response."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None

    def add(self, delta: TextDelta) -> None:
        self.parts.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


class CompletionFormatter:
    """`/v1/completions` objects (`text_completion`)."""

    def __init__(
        self, request_id: str, model: str, plan: OutputPlan, created: int | None = None
    ) -> None:
        self._id = request_id
        self._model = model
        self._plan = plan
        self._created = created or int(time.time())
        self._acc = _Accumulator()
        self._echo_pending = plan.echo_text is not None
        self._offset = len(plan.echo_text or "")  # text_offset of the next token

    def events(self, delta: TextDelta) -> bytes:
        text = self._take_echo() + delta.text
        if not text and delta.finish_reason is None and not delta.logprobs:
            return b""
        choice = CompletionChoice(
            index=0,
            text=text,
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=delta.finish_reason,
        )
        return sse_event(self._wrap([choice]))

    def usage_event(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        return sse_event(self._wrap([], usage, metrics))

    def add(self, delta: TextDelta) -> None:
        self._acc.add(delta)

    def body(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        acc = self._acc
        text = self._take_echo() + acc.text
        logprobs = self._logprobs(acc.logprobs) if self._plan.logprobs is not None else None
        choice = CompletionChoice(
            index=0, text=text, logprobs=logprobs, finish_reason=acc.finish_reason
        )
        return encode_json(self._wrap([choice], usage, metrics))

    def _wrap(
        self,
        choices: list[CompletionChoice],
        usage: Usage | None = None,
        metrics: PerRequestMetrics | None = None,
    ) -> Completion:
        return Completion(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=choices,
            usage=usage,
            metrics=metrics,
        )

    def _take_echo(self) -> str:
        if not self._echo_pending:
            return ""
        self._echo_pending = False
        return self._plan.echo_text or ""

    def _logprobs(self, items: list[TokenLogprobs] | None) -> CompletionLogprobs | None:
        if self._plan.logprobs is None or items is None:
            return None
        offsets = []
        for item in items:
            offsets.append(self._offset)
            self._offset += len(item.sampled.token)
        return CompletionLogprobs(
            tokens=[i.sampled.token for i in items],
            token_logprobs=[i.sampled.logprob for i in items],
            top_logprobs=[{alt.token: alt.logprob for alt in i.top} for i in items],
            text_offset=offsets,
        )


class ChatFormatter:
    """`/v1/chat/completions` objects (`chat.completion` / `chat.completion.chunk`)."""

    def __init__(
        self, request_id: str, model: str, plan: OutputPlan, created: int | None = None
    ) -> None:
        self._id = request_id
        self._model = model
        self._plan = plan
        self._created = created or int(time.time())
        self._acc = _Accumulator()
        self._role_sent = False

    def events(self, delta: TextDelta) -> bytes:
        if (
            self._role_sent
            and not delta.text
            and delta.finish_reason is None
            and not delta.logprobs
        ):
            return b""
        role = None if self._role_sent else "assistant"
        self._role_sent = True
        content = delta.text if (delta.text or role) else None
        choice = ChatChunkChoice(
            index=0,
            delta=ChatDelta(role=role, content=content),
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=delta.finish_reason,
        )
        return sse_event(self._chunk([choice]))

    def usage_event(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        return sse_event(self._chunk([], usage, metrics))

    def add(self, delta: TextDelta) -> None:
        self._acc.add(delta)

    def body(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        acc = self._acc
        logprobs = self._logprobs(acc.logprobs) if self._plan.logprobs is not None else None
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(role="assistant", content=acc.text),
            logprobs=logprobs,
            finish_reason=acc.finish_reason,
        )
        return encode_json(
            ChatCompletion(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[choice],
                usage=usage,
                metrics=metrics,
            )
        )

    def _chunk(
        self,
        choices: list[ChatChunkChoice],
        usage: Usage | None = None,
        metrics: PerRequestMetrics | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=choices,
            usage=usage,
            metrics=metrics,
        )

    def _logprobs(self, items: list[TokenLogprobs] | None) -> ChatLogprobs | None:
        if self._plan.logprobs is None or items is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=i.sampled.token,
                    logprob=i.sampled.logprob,
                    bytes=i.sampled.bytes,
                    top_logprobs=[ChatTopLogprob(a.token, a.logprob, a.bytes) for a in i.top],
                )
                for i in items
            ]
        )
