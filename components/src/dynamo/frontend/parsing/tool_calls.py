"""Tool calling on the response side: which output a request's `tool_choice` asks for, and
the parsers that turn the model's text back into OpenAI `tool_calls` (the request's tools
are checked, and their constraint built, by `preprocess.tools`).

Per `tool_choice`:

* `none`: the tools are still rendered into the prompt (vLLM 0.32's default,
  `--exclude-tools-when-tool-choice-none` off), the output is plain text.
* `auto` (or tools without `tool_choice`): the model decides; its text is read by one of
  vLLM's own tool parsers, picked with `--tool-call-parser` (`AutoToolCalls` adapts it to
  `ChatOutputParser`). Without that flag the request is a 400, as `vllm serve` refuses
  it without `--enable-auto-tool-choice --tool-call-parser`.
* `required` and a named function: the output is constrained with structured output to a
  JSON document built from the tools' schemas, so every call is valid JSON for its
  schema; `RequiredToolCalls` / `NamedToolCall` read that document back (the model's
  own tool-call format plays no part, as in vLLM).

vLLM is imported only when `--tool-call-parser` is given (its import takes seconds).
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgspec

from dynamo.frontend.openai.errors import bad_request
from dynamo.frontend.openai.protocol import (
    ChatCompletionRequest,
    ToolChoiceFunction,
)
from dynamo.frontend.parsing.chat_output import ChatOutputParser, ChatPieces, ToolCallDelta

log = logging.getLogger(__name__)

TOOL_CHOICES = ("none", "auto", "required")


class ToolMode(Enum):
    """How a request's output relates to its tools."""

    NONE = "none"  # no tools, or tool_choice none: plain text
    AUTO = "auto"  # the model decides; a tool parser reads its text
    REQUIRED = "required"  # one or more calls, constrained to the tools' schemas
    NAMED = "named"  # exactly one call of the named function, constrained


# ---------------------------------------------------------------------- the request


def tool_mode(req: ChatCompletionRequest, tool_call_parser: str | None) -> ToolMode:
    """What `req` asks of its tools. 400 for a `tool_choice` without tools, an unknown
    `tool_choice`, or automatic tool choice with no `--tool-call-parser` configured."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise bad_request("`tool_choice` needs `tools`", "tool_choice")
        return ToolMode.NONE
    if isinstance(choice, ToolChoiceFunction):
        return ToolMode.NAMED
    if choice == "none":
        return ToolMode.NONE
    if choice == "required":
        return ToolMode.REQUIRED
    if choice is None or choice == "auto":
        if tool_call_parser is None:
            raise bad_request(
                "`tool_choice` `auto` (the default when `tools` are given) needs a tool-call "
                "parser: start the frontend with `--tool-call-parser NAME` (e.g. `hermes`), "
                'or send `tool_choice` `"required"` or a named function',
                "tool_choice",
            )
        return ToolMode.AUTO
    raise bad_request(
        f"`tool_choice` `{choice}` is not supported; use one of "
        + ", ".join(f"`{c}`" for c in TOOL_CHOICES)
        + ' or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def new_tool_call_id() -> str:
    """An id in vLLM's shape (`chatcmpl-tool-<hex>`)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------- required / named


class NamedToolCall:
    """The output of a named `tool_choice`: the arguments object itself, constrained to
    the function's parameters schema. Streams incrementally: the first piece carries the
    id and name, every later piece appends the text to the arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        if not text:
            return ChatPieces()
        if not self._started:
            self._started = True
            first = ToolCallDelta(index=0, id=new_tool_call_id(), name=self._name, arguments=text)
            return ChatPieces(tool_calls=[first])
        return ChatPieces(tool_calls=[ToolCallDelta(index=0, arguments=text)])

    def finish(self) -> ChatPieces:
        return ChatPieces()

    @property
    def made_tool_calls(self) -> bool:
        return self._started


class RequiredToolCalls:
    """The output of `tool_choice` `required`: a JSON array of `{"name", "parameters"}`,
    constrained by `required_schema`. The calls are emitted when the array is complete
    (at the end); output the engine cut short (`length`) is not valid JSON and comes back
    as content, so the client sees what was generated."""

    def __init__(self) -> None:
        self._text = ""
        self._made = False

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        self._text += text
        return ChatPieces()

    def finish(self) -> ChatPieces:
        calls = _calls_from_array(self._text)
        if calls is None:
            return ChatPieces(content=self._text)
        self._made = bool(calls)
        return ChatPieces(tool_calls=calls)

    @property
    def made_tool_calls(self) -> bool:
        return self._made


def _calls_from_array(text: str) -> list[ToolCallDelta] | None:
    try:
        items = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(ToolCallDelta(index, new_tool_call_id(), item["name"], arguments))
    return calls


# ---------------------------------------------------------------------- auto (vLLM's parsers)


def tool_parser_names() -> list[str]:
    """The names `--tool-call-parser` accepts: vLLM's registered tool parsers."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


@functools.cache
def tool_parser_class(name: str) -> Any:
    """vLLM's tool parser class registered as `name`. Raises ValueError listing the valid
    names for an unknown one (a start-up error, not a per-request one)."""
    from vllm.tool_parsers import ToolParserManager

    names = tool_parser_names()
    if name not in names:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {', '.join(names)}")
    return ToolParserManager.get_tool_parser(name)


MIN_PARSE_CHARS = 32
"""Inside a tool call, the least text handed to the parser at once (see `_worth_parsing`)."""


@dataclass
class _PendingCall:
    """A call the vLLM parser is streaming; emitted once its arguments are complete."""

    name: str = ""
    arguments: str = ""


@dataclass
class AutoToolCalls:
    """One of vLLM's tool parsers (`extract_tool_calls_streaming`) as a `ChatOutputParser`.

    Content streams as the vLLM parser releases it. A call is emitted whole (id, name,
    arguments in one piece) as soon as its arguments are a complete JSON object, or at the
    end: a call is never sent half-valid, so a client never has to retract one. At the
    end the whole text is parsed once more (`extract_tool_calls`) to release what the
    streaming parser still held: calls it had not finished, or, when the text holds no
    valid call (broken JSON), the rest of the text as content."""

    parser: Any  # vllm.tool_parsers.ToolParser
    request: Any  # vllm's ChatCompletionRequest, which the parsers read
    _text: str = ""
    _token_ids: list[int] = field(default_factory=list)
    _content_sent: str = ""
    _pending: dict[int, _PendingCall] = field(default_factory=dict)
    _emitted: int = 0
    _unparsed: str = ""
    _unparsed_ids: list[int] = field(default_factory=list)

    def feed(self, text: str, token_ids: Sequence[int]) -> ChatPieces:
        self._unparsed += text
        self._unparsed_ids.extend(token_ids)
        if self._pending and not self._worth_parsing(text):
            return ChatPieces()
        return self._parse_unparsed()

    def _worth_parsing(self, text: str) -> bool:
        """Once the parser has started a call, what matters is when a call's arguments
        close: vLLM's parsers re-parse the whole text on every delta (quadratic over a
        long call), so the text is handed over when a `}` may have closed them, or when
        it grew by an eighth. (Content before the first call streams delta by delta.)"""
        grown = len(self._unparsed)
        return "}" in text or grown >= max(MIN_PARSE_CHARS, len(self._text) // 8)

    def _parse_unparsed(self) -> ChatPieces:
        text, token_ids = self._unparsed, self._unparsed_ids
        self._unparsed, self._unparsed_ids = "", []
        previous_text, previous_ids = self._text, list(self._token_ids)
        self._text += text
        self._token_ids.extend(token_ids)
        try:
            delta = self.parser.extract_tool_calls_streaming(
                previous_text,
                self._text,
                text,
                previous_ids,
                self._token_ids,
                list(token_ids),
                self.request,
            )
        except Exception:  # a parser bug must not kill the stream: the end re-parses
            log.exception("tool-call parser failed on a delta; continuing")
            return ChatPieces()
        pieces = ChatPieces()
        if delta is None:
            return pieces
        if delta.content:
            pieces.content = delta.content
            self._content_sent += delta.content
        for call in delta.tool_calls or []:
            self._take(call)
        pieces.tool_calls = self._complete_calls()
        return pieces

    def finish(self) -> ChatPieces:
        self._text += self._unparsed  # held back inside a call: the full parse reads it
        self._unparsed = ""
        try:
            info = self.parser.extract_tool_calls(self._text, self.request)
        except Exception:
            log.exception("tool-call parser failed on the full text")
            info = None
        pieces = ChatPieces()
        if info is not None and info.tools_called:
            content = info.content or ""
            if content.startswith(self._content_sent):
                pieces.content = content[len(self._content_sent) :]
            for call in info.tool_calls[self._emitted :]:
                pieces.tool_calls.extend(self._emit(call.function.name, call.function.arguments))
        elif self._emitted == 0 and self._text.startswith(self._content_sent):
            # No valid call in the text: what was held back (a marker, a broken call) is
            # content, as vLLM's non-streaming path returns it.
            pieces.content = self._text[len(self._content_sent) :]
        elif self._pending:
            log.warning("dropped a tool call whose arguments are not valid JSON")
        self._pending.clear()
        return pieces

    @property
    def made_tool_calls(self) -> bool:
        return self._emitted > 0

    def _take(self, call: Any) -> None:
        pending = self._pending.setdefault(call.index, _PendingCall())
        function = call.function
        if function is None:
            return
        if function.name:
            pending.name = function.name
        if function.arguments:
            pending.arguments += function.arguments

    def _complete_calls(self) -> list[ToolCallDelta]:
        """Calls, in order, whose arguments now parse as a JSON object (a complete object
        cannot grow: the parser streams argument text as a prefix)."""
        ordered = [self._pending[i] for i in sorted(self._pending)]
        out: list[ToolCallDelta] = []
        while self._emitted < len(ordered):
            pending = ordered[self._emitted]
            if not (pending.name and _is_json_object(pending.arguments)):
                break
            out.extend(self._emit(pending.name, pending.arguments))
        return out

    def _emit(self, name: str, arguments: str) -> list[ToolCallDelta]:
        index = self._emitted
        self._emitted += 1
        return [ToolCallDelta(index=index, id=new_tool_call_id(), name=name, arguments=arguments)]


def _is_json_object(text: str) -> bool:
    if not text.rstrip().endswith("}"):  # cheap: most deltas of a call's arguments
        return False
    try:
        return isinstance(json.loads(text), dict)
    except (json.JSONDecodeError, RecursionError):
        return False


def auto_tool_calls(req: ChatCompletionRequest, parser_name: str, tokenizer: Any) -> AutoToolCalls:
    """A fresh vLLM parser (they keep per-response state) for one response to `req`."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChatRequest,
    )

    tools = [msgspec.to_builtins(tool) for tool in req.tools or []]
    vllm_request = VllmChatRequest(messages=[], model=req.model, tools=tools, tool_choice="auto")
    parser = tool_parser_class(parser_name)(tokenizer, vllm_request.tools)
    return AutoToolCalls(parser=parser, request=vllm_request)


def tool_output_parser(
    req: ChatCompletionRequest, mode: ToolMode, parser_name: str | None, tokenizer: Any
) -> ChatOutputParser:
    """The parser that turns `req`'s output into tool calls (`mode` is not NONE)."""
    if mode is ToolMode.NAMED:
        assert isinstance(req.tool_choice, ToolChoiceFunction)
        return NamedToolCall(req.tool_choice.function.name)
    if mode is ToolMode.REQUIRED:
        return RequiredToolCalls()
    assert parser_name is not None  # tool_mode refused AUTO without one
    return auto_tool_calls(req, parser_name, tokenizer)
