"""The `/v1/chat/completions` formatter: `chat.completion` and `chat.completion.chunk`
objects from `TextDelta`s, each choice's text split by its `ChatOutputParser` into
content, reasoning and tool calls.

Separate from the completion formatter because only chat responses carry a role, parsed
output and tool calls: what the two share lives in `formatters.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    FunctionCall,
    FunctionCallDelta,
    PerRequestMetrics,
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
from dynamo.frontend.postprocess.formatters import (
    ChoiceAccumulator,
    ChoicesFormatter,
    encode_json,
    prompt_logprobs_field,
    sse_event,
)
from dynamo.frontend.postprocess.postprocessor import TextDelta, TokenLogprobs


class _ChatChoice:
    """One choice of a chat response: its own output parser (parsers hold text back
    between deltas, so choices must not share one), its accumulated parts and whether its
    first chunk (the one carrying the role) went out."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.acc = ChoiceAccumulator()
        self.pieces = ChatPieces()  # the non-streaming body's parts, merged
        self.role_sent = False


@dataclass(eq=False)
class ChatFormatter(ChoicesFormatter[_ChatChoice]):
    """`/v1/chat/completions` objects (`chat.completion` / `chat.completion.chunk`).

    Text goes through the choice's `ChatOutputParser` (plain text unless a reasoning
    parser or tools are in play), which splits it into content, reasoning and tool calls;
    a response that made tool calls finishes with `tool_calls` instead of `stop`.

    With `n` > 1 every choice (the delta's `index`) gets its own parser from
    `parser_factory`; `parser`, when given, is choice 0's. Without a factory, choices
    other than 0 are plain text only if no `parser` was given either (a lone parser
    instance cannot serve several choices: that is a wiring error, raised)."""

    chunk_type = ChatCompletionChunk

    parser: ChatOutputParser | None = None
    parser_factory: Callable[[], ChatOutputParser] | None = None

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
        content = (self.plan.echo_text or "") + pieces.content if first else pieces.content
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
            token_ids=delta.generated_ids if self.plan.return_token_ids else None,
        )
        prompt_ids = self.plan.prompt_token_ids if first else None
        return sse_event(self._response(ChatCompletionChunk, [choice], prompt_token_ids=prompt_ids))

    def add(self, delta: TextDelta) -> None:
        state = self._choice(delta.index)
        state.acc.add(delta)
        state.pieces.extend(self._parse(state, delta))
        self._prompt.extend(delta.prompt_logprobs or ())

    def body(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        return encode_json(
            self._response(
                ChatCompletion,
                [self._body_choice(index) for index in self._body_indices()],
                usage,
                metrics,
                prompt_token_ids=self.plan.prompt_token_ids,
                prompt_logprobs=(
                    prompt_logprobs_field(self._prompt)
                    if self.plan.prompt_logprobs is not None
                    else None
                ),
            )
        )

    def _body_choice(self, index: int) -> ChatChoice:
        state = self._choice(index)
        acc = state.acc
        pieces = state.pieces
        logprobs = self._logprobs(acc.logprobs) if self.plan.logprobs is not None else None
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in merge_tool_calls(pieces.tool_calls)
        ]
        # null when the message is only tool calls or only reasoning (as vLLM sends it)
        content = pieces.content or (None if calls or pieces.reasoning else "")
        if self.plan.echo_text:
            content = self.plan.echo_text + (content or "")
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
            token_ids=acc.generated_ids if self.plan.return_token_ids else None,
        )

    def _new_choice(self, index: int) -> _ChatChoice:
        return _ChatChoice(self._new_parser(index))

    def _new_parser(self, index: int) -> ChatOutputParser:
        if index == 0 and self.parser is not None:
            return self.parser
        if self.parser_factory is not None:
            return self.parser_factory()
        if self.parser is not None:
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

    def _logprobs(self, items: list[TokenLogprobs] | None) -> ChatLogprobs | None:
        if self.plan.logprobs is None or items is None:
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
