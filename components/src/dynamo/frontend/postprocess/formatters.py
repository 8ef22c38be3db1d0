"""OpenAI response objects from `TextDelta`s: the only module that knows the completion
and chat response shapes.

A formatter serves one request. In streaming mode `events(delta)` gives the chunk(s) for a
delta, already encoded as Server-Sent Events; otherwise `add(delta)` accumulates and
`body(usage)` builds the final JSON. Encoding uses msgspec (a few microseconds per chunk),
because it runs once per streamed batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from dynamo.frontend.openai.errors import OpenAIError, error_event
from dynamo.frontend.openai.protocol import (
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
    FunctionCall,
    FunctionCallDelta,
    PerRequestMetrics,
    PromptLogprob,
    PromptLogprobsField,
    ToolCall,
    ToolCallChunk,
    Usage,
)
from dynamo.frontend.parsing.chat_output import (
    ChatOutputParser,
    ChatPieces,
    PlainText,
    ToolCallDelta,
    merge_tool_calls,
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


class _Accumulator:
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


class _CompletionChoice:
    """One choice of a completion response: its accumulated text and its echo/offsets."""

    def __init__(self, echo_text: str | None) -> None:
        self.acc = _Accumulator()
        self.echo_pending = echo_text is not None
        self.offset = len(echo_text or "")  # text_offset of the next token
        self.prompt_ids_sent = False  # `return_token_ids`: on the first chunk only


class CompletionFormatter(ChunkStreamEnd):
    """`/v1/completions` objects (`text_completion`). With `n` > 1 each choice (the
    delta's `index`) keeps its own text, echo and logprob offsets."""

    def __init__(
        self, request_id: str, model: str, plan: OutputPlan, created: int | None = None
    ) -> None:
        self._id = request_id
        self._model = model
        self._plan = plan
        self._created = created or int(time.time())
        self._choices: dict[int, _CompletionChoice] = {}
        self._prompt: list[PromptPosition] = []  # the prompt's logprobs, as they arrive

    def events(self, delta: TextDelta) -> bytes:
        state = self._choice(delta.index)
        self._prompt.extend(delta.prompt_logprobs or ())
        echo_items = self._echo_logprobs() if state.echo_pending else None
        text = self._take_echo(state) + delta.text
        if (
            not text
            and delta.finish_reason is None
            and not delta.logprobs
            and not delta.generated_ids
        ):
            return b""
        choice = CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=self._logprobs(state, delta.logprobs, echo_items),
            finish_reason=delta.finish_reason,
            **self._token_ids(state, delta.generated_ids),
        )
        return sse_event(self._wrap([choice]))

    def usage_event(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        return sse_event(self._wrap([], usage, metrics))

    def add(self, delta: TextDelta) -> None:
        self._choice(delta.index).acc.add(delta)
        self._prompt.extend(delta.prompt_logprobs or ())

    def body(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        choices = [self._body_choice(index) for index in sorted(self._choices or {0: None})]
        return encode_json(self._wrap(choices, usage, metrics))

    def _body_choice(self, index: int) -> CompletionChoice:
        state = self._choice(index)
        acc = state.acc
        echo_items = self._echo_logprobs() if state.echo_pending else None
        text = self._take_echo(state) + acc.text
        logprobs = None
        if self._plan.logprobs is not None:
            logprobs = self._logprobs(state, acc.logprobs, echo_items)
        prompt_logprobs = None
        if self._plan.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_field(self._prompt)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=acc.finish_reason,
            prompt_logprobs=prompt_logprobs,
            **self._token_ids(state, acc.generated_ids),
        )

    def _echo_logprobs(self) -> CompletionLogprobs | None:
        """The echoed prompt's part of `logprobs` (vLLM reports one entry per prompt
        token before the completion's; the first has no logprob), when both were asked
        for and the prompt's logprobs have arrived."""
        if self._plan.logprobs is None or not self._prompt:
            return None
        offsets, offset = [], 0
        for position in self._prompt:
            offsets.append(offset)
            offset += len(position.text)
        return CompletionLogprobs(
            tokens=[p.text for p in self._prompt],
            token_logprobs=[p.logprob for p in self._prompt],
            top_logprobs=[
                None
                if p.ranked is None
                else {e.alternative.token: e.alternative.logprob for e in p.ranked}
                for p in self._prompt
            ],
            text_offset=offsets,
        )

    def _token_ids(self, state: _CompletionChoice, generated: list[int]) -> dict[str, Any]:
        """`prompt_token_ids` (once per choice) and `token_ids`, with `return_token_ids`."""
        if not self._plan.return_token_ids:
            return {}
        fields: dict[str, Any] = {"token_ids": generated}
        if not state.prompt_ids_sent:
            state.prompt_ids_sent = True
            fields["prompt_token_ids"] = self._plan.prompt_token_ids
        return fields

    def _choice(self, index: int) -> _CompletionChoice:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _CompletionChoice(self._plan.echo_text)
        return state

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

    def _take_echo(self, state: _CompletionChoice) -> str:
        """The echoed prompt, once per choice (each choice starts with it)."""
        if not state.echo_pending:
            return ""
        state.echo_pending = False
        return self._plan.echo_text or ""

    def _logprobs(
        self,
        state: _CompletionChoice,
        items: list[TokenLogprobs] | None,
        echoed: CompletionLogprobs | None = None,
    ) -> CompletionLogprobs | None:
        """The generated tokens' logprobs, after the echoed prompt's when there are any."""
        if self._plan.logprobs is None or (items is None and echoed is None):
            return None
        items = items or []
        offsets = []
        for item in items:
            offsets.append(state.offset)
            state.offset += len(item.sampled.token)
        generated = CompletionLogprobs(
            tokens=[i.sampled.token for i in items],
            token_logprobs=[i.sampled.logprob for i in items],
            top_logprobs=[{alt.token: alt.logprob for alt in i.top} for i in items],
            text_offset=offsets,
        )
        if echoed is None:
            return generated
        return CompletionLogprobs(
            tokens=echoed.tokens + generated.tokens,
            token_logprobs=echoed.token_logprobs + generated.token_logprobs,
            top_logprobs=(echoed.top_logprobs or []) + (generated.top_logprobs or []),
            text_offset=echoed.text_offset + generated.text_offset,
        )


class _ChatChoice:
    """One choice of a chat response: its own output parser (parsers hold text back
    between deltas, so choices must not share one), its accumulated parts and whether its
    first chunk (the one carrying the role) went out."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.acc = _Accumulator()
        self.pieces = ChatPieces()  # the non-streaming body's parts, merged
        self.role_sent = False


class ChatFormatter(ChunkStreamEnd):
    """`/v1/chat/completions` objects (`chat.completion` / `chat.completion.chunk`).

    Text goes through the choice's `ChatOutputParser` (plain text unless a reasoning
    parser or tools are in play), which splits it into content, reasoning and tool calls;
    a response that made tool calls finishes with `tool_calls` instead of `stop`.

    With `n` > 1 every choice (the delta's `index`) gets its own parser from
    `parser_factory`; `parser`, when given, is choice 0's. Without a factory, choices
    other than 0 are plain text only if no `parser` was given either (a lone parser
    instance cannot serve several choices: that is a wiring error, raised)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        plan: OutputPlan,
        created: int | None = None,
        parser: ChatOutputParser | None = None,
        parser_factory: Callable[[], ChatOutputParser] | None = None,
    ) -> None:
        self._id = request_id
        self._model = model
        self._plan = plan
        self._created = created or int(time.time())
        self._first_parser = parser
        self._parser_factory = parser_factory
        self._choices: dict[int, _ChatChoice] = {}
        self._prompt: list[PromptPosition] = []  # the prompt's logprobs, as they arrive

    def events(self, delta: TextDelta) -> bytes:
        state = self._choice(delta.index)
        pieces = self._parse(state, delta)
        if (
            state.role_sent
            and not pieces
            and delta.finish_reason is None
            and not delta.logprobs
            and not delta.generated_ids
        ):
            return b""
        first = not state.role_sent
        state.role_sent = True
        role = "assistant" if first else None
        # The echoed last message (vLLM's `echo`) opens the first chunk's content.
        content = (self._plan.echo_text or "") + pieces.content if first else pieces.content
        choice = ChatChunkChoice(
            index=delta.index,
            delta=ChatDelta(
                role=role,
                content=content if (content or role) else None,
                reasoning_content=pieces.reasoning or None,
                tool_calls=[_tool_call_chunk(p) for p in pieces.tool_calls] or None,
            ),
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=self._finish_reason(state, delta.finish_reason),
            token_ids=delta.generated_ids if self._plan.return_token_ids else None,
        )
        prompt_ids = self._plan.prompt_token_ids if first else None
        return sse_event(self._chunk([choice], prompt_token_ids=prompt_ids))

    def usage_event(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        return sse_event(self._chunk([], usage, metrics))

    def add(self, delta: TextDelta) -> None:
        state = self._choice(delta.index)
        state.acc.add(delta)
        state.pieces.extend(self._parse(state, delta))
        self._prompt.extend(delta.prompt_logprobs or ())

    def body(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        indices = sorted(self._choices) or [0]
        return encode_json(
            ChatCompletion(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[self._body_choice(index) for index in indices],
                usage=usage,
                metrics=metrics,
                prompt_token_ids=self._plan.prompt_token_ids,
                prompt_logprobs=(
                    prompt_logprobs_field(self._prompt)
                    if self._plan.prompt_logprobs is not None
                    else None
                ),
            )
        )

    def _body_choice(self, index: int) -> ChatChoice:
        state = self._choice(index)
        acc = state.acc
        pieces = state.pieces
        logprobs = self._logprobs(acc.logprobs) if self._plan.logprobs is not None else None
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in merge_tool_calls(pieces.tool_calls)
        ]
        # null when the message is only tool calls or only reasoning (as vLLM sends it)
        content = pieces.content or (None if calls or pieces.reasoning else "")
        if self._plan.echo_text:
            content = self._plan.echo_text + (content or "")
        message = AssistantMessage(
            role="assistant",
            content=content,
            reasoning_content=pieces.reasoning or None,
            tool_calls=calls,
        )
        return ChatChoice(
            index=index,
            message=message,
            logprobs=logprobs,
            finish_reason=self._finish_reason(state, acc.finish_reason),
            token_ids=acc.generated_ids if self._plan.return_token_ids else None,
        )

    def _choice(self, index: int) -> _ChatChoice:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _ChatChoice(self._new_parser(index))
        return state

    def _new_parser(self, index: int) -> ChatOutputParser:
        if index == 0 and self._first_parser is not None:
            return self._first_parser
        if self._parser_factory is not None:
            return self._parser_factory()
        if self._first_parser is not None:
            raise RuntimeError("ChatFormatter: a response with n > 1 needs a parser_factory")
        return PlainText()

    @staticmethod
    def _parse(state: _ChatChoice, delta: TextDelta) -> ChatPieces:
        """The delta's text split by the choice's parser; at the end, what it still held."""
        parser = state.parser
        pieces = parser.feed(delta.text, delta.token_ids) if delta.text else ChatPieces()
        if delta.done:
            pieces.extend(parser.finish())
        return pieces

    @staticmethod
    def _finish_reason(state: _ChatChoice, reason: str | None) -> str | None:
        if reason == "stop" and state.parser.made_tool_calls:
            return "tool_calls"
        return reason

    def _chunk(
        self,
        choices: list[ChatChunkChoice],
        usage: Usage | None = None,
        metrics: PerRequestMetrics | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=choices,
            usage=usage,
            metrics=metrics,
            prompt_token_ids=prompt_token_ids,
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


def _tool_call_chunk(piece: ToolCallDelta) -> ToolCallChunk:
    return ToolCallChunk(
        index=piece.index,
        id=piece.id,
        type="function" if piece.id is not None else None,
        function=FunctionCallDelta(name=piece.name, arguments=piece.arguments or None),
    )
