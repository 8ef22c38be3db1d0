"""The assistant's generated text, split into the parts the chat API returns separately.

An OpenAI chat response carries up to three things the model wrote as one stream of
tokens: `content`, `reasoning_content` (a reasoning model's thinking, vLLM's extension
field) and `tool_calls`. Which spans are which depends on the model's output format, so
the split is done by parsers chosen per model (`--reasoning-parser`,
`--tool-call-parser`) and per request (`tools`, `tool_choice`).

This module is the seam between those parsers and the response formatter
(`postprocess/chat_formatter.py`): the formatter feeds every text delta, with the token ids it
came from, to one `ChatOutputParser` and writes what comes back. The same path serves
streaming and non-streaming responses, so the two cannot disagree: the non-streaming
body is the merge of what the stream would have carried.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call, OpenAI's streaming shape: the first piece of a call
    carries its `id` and function `name`, later pieces append to its `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ChatPieces:
    """What one delta of generated text contributes to each part of the message."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: ChatPieces) -> None:
        """Append `other` after this one (text concatenated, tool-call pieces kept in
        order)."""
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


class ChatOutputParser(Protocol):
    """Splits a response's text, delta by delta, into content, reasoning and tool calls.

    Parsers may hold text back (a marker that might be starting) and release it later;
    `finish` is called once after the last delta and must release everything held."""

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        """The parts of the message `text` (decoded from `token_ids`) adds."""
        ...

    def finish(self) -> ChatPieces:
        """Whatever is still held back, at the end of the response."""
        ...

    @property
    def made_tool_calls(self) -> bool:
        """Whether any tool call was emitted: the finish reason is then `tool_calls`."""
        ...


class PlainText:
    """No parsing: all text is content (no reasoning parser, no tools in the request)."""

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        return ChatPieces(content=text)

    def finish(self) -> ChatPieces:
        return ChatPieces()

    @property
    def made_tool_calls(self) -> bool:
        return False


@dataclass
class MergedToolCall:
    """One tool call assembled from its streamed pieces, for a non-streaming body."""

    id: str
    name: str
    arguments: str = ""


def merge_tool_calls(pieces: Sequence[ToolCallDelta]) -> list[MergedToolCall]:
    """The complete calls the pieces spell, in index order."""
    calls: dict[int, MergedToolCall] = {}
    for piece in pieces:
        call = calls.get(piece.index)
        if call is None:
            call = calls[piece.index] = MergedToolCall(id=piece.id or "", name=piece.name or "")
        else:
            call.id = call.id or piece.id or ""
            call.name = call.name or piece.name or ""
        call.arguments += piece.arguments
    return [calls[index] for index in sorted(calls)]
