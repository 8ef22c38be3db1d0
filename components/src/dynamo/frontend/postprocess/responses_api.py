"""OpenAI's Responses API (`POST /v1/responses`) as a thin layer over chat completions.

Only the text subset is served: `input` as a string or a list of messages (roles `user`,
`system`, `developer`, `assistant`; `input_text` / `output_text` parts), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `stream`, and `text.format` (`text`,
`json_object`, `json_schema`) as structured output. Such a request is converted into the
`ChatCompletionRequest` it means (`to_chat_request`) and then takes the chat path all the
way: the same admission, chat template, sampling defaults, validation, routing and
engine stream. Only the shape of the answer differs, which `ResponsesFormatter` (a
`ResponseFormatter` of `formatters.py`) builds: the `response` object, or, streaming, the
typed events `response.created` ... `response.completed` with increasing
`sequence_number`s.

Nothing is stored. `store: true` (the API's default) is accepted, because every client
sends it, and ignored: the response object says `store: false`. Whatever would need
stored state (`previous_response_id`, `conversation`, `background: true`) or a feature
we do not serve through this endpoint (`tools`, `reasoning`, `include`, `prompt`, ...)
is a 400 naming the field (the `responses` rows of `unsupported_fields.SUPPORT`), never
a 200 that ignored it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

import msgspec

from dynamo.frontend.openai.errors import OpenAIError, bad_request
from dynamo.frontend.openai.limits import MAX_MESSAGES
from dynamo.frontend.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaSpec,
    PerRequestMetrics,
    ResponseFormat,
    StreamOptions,
    Usage,
)
from dynamo.frontend.openai.responses_protocol import (
    ContentPartAdded,
    ContentPartDone,
    IncompleteDetails,
    InputContentPart,
    InputItem,
    InputTokensDetails,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextConfig,
)
from dynamo.frontend.openai.unsupported_fields import Endpoint, unsupported
from dynamo.frontend.openai.unsupported_fields import refuse_unserved as refuse_unserved_fields
from dynamo.frontend.postprocess.formatters import encode_json
from dynamo.frontend.postprocess.postprocessor import TextDelta
from dynamo.frontend.preprocess.preprocessor import OutputPlan, Prepared, Preprocessor

# --------------------------------------------------------------------------- refusals


def refuse_unserved(req: ResponsesRequest) -> None:
    """400 naming the first field `req` sets to a value we do not serve (the Responses
    rows of `unsupported_fields.SUPPORT`, and `text.verbosity`)."""
    refuse_unserved_fields(req, Endpoint.RESPONSES)
    if req.text is not None and req.text.verbosity is not None:
        raise unsupported("text.verbosity", "no verbosity control")


# --------------------------------------------------------------------------- conversion


@dataclass(frozen=True)
class ResponseEcho:
    """Request fields the response object repeats (OpenAI echoes them)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    parallel_tool_calls: bool = True
    tool_choice: str = "auto"

    def repeated(self) -> dict[str, Any]:
        """The fields as `ResponseObject` keywords (each field is one of the response's;
        shallow: the values are not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def of(cls, req: ResponsesRequest) -> ResponseEcho:
        fmt = req.text.format if req.text is not None else None
        text = {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}}
        return cls(
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            metadata=dict(req.metadata or {}),
            user=req.user,
            text=text,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=req.tool_choice if isinstance(req.tool_choice, str) else "auto",
        )


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text"})


class ResponsesChatRequest(ChatCompletionRequest, kw_only=True):
    """The chat request a /v1/responses request means, with what its response object
    repeats (`response_echo`; `echo` is a chat field). From here on the request takes
    the chat path."""

    response_echo: ResponseEcho


def to_chat_request(req: ResponsesRequest) -> ResponsesChatRequest:
    """The chat completion request `req` means. Raises `OpenAIError` (400 naming the
    field) for what it asks and we do not serve. `developer` messages become `system`
    ones (chat templates know no `developer` role), `instructions` a first system
    message; streaming always asks for usage, which `response.completed` carries."""
    refuse_unserved(req)
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages += _messages(req.input)
    return ResponsesChatRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
        response_format=_response_format(req.text),
        user=req.user,
        metadata=req.metadata,
        return_spec_stats=req.return_spec_stats,
        speculative_decoding=req.speculative_decoding,
        response_echo=ResponseEcho.of(req),
    )


def _messages(input_: str | list[InputItem]) -> list[ChatMessage]:
    if isinstance(input_, str):
        return [ChatMessage(role="user", content=input_)]
    if not input_:
        raise bad_request("`input` must contain at least one message", "input")
    if len(input_) > MAX_MESSAGES:  # the chat path's bound, checked before converting
        raise bad_request(
            f"`input` has {len(input_)} items; at most {MAX_MESSAGES} are allowed", "input"
        )
    return [_message(i, item) for i, item in enumerate(input_)]


def _message(index: int, item: InputItem) -> ChatMessage:
    where = f"input[{index}]"
    if item.type not in (None, "message"):
        raise bad_request(
            f"`{where}.type` `{item.type}` is not supported: only `message` items are "
            "served (no tool calls, reasoning or item references)",
            "input",
            code="unsupported_parameter",
        )
    if item.role not in _ROLES:
        raise bad_request(
            f"`{where}.role` must be one of `user`, `system`, `developer`, `assistant`",
            "input",
        )
    return ChatMessage(role=_ROLES[item.role], content=_text(where, item.content))


def _text(where: str, content: str | list[InputContentPart] | None) -> str:
    if content is None:
        raise bad_request(f"`{where}.content` is required", "input")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise bad_request(
                f"`{where}.content[{j}].type` `{part.type}` is not supported: only "
                "`input_text` and `output_text` parts with `text` are served",
                "input",
                code="unsupported_parameter",
            )
        texts.append(part.text)
    return "\n".join(texts)  # as the chat path joins text parts


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    """`text.format` as chat's `response_format`, which `structured_output` validates
    (schema errors name `text.format` once `translated` renames them)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if not fmt.name:
            raise bad_request("`text.format.name` is required for `json_schema`", "text.format")
        if fmt.schema_ is None:
            raise bad_request("`text.format.schema` is required for `json_schema`", "text.format")
        spec = JsonSchemaSpec(
            name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict
        )
        return ResponseFormat(type="json_schema", json_schema=spec)
    raise bad_request(
        f"`text.format.type` `{fmt.type}` is not supported; use `text`, `json_object` or "
        "`json_schema`",
        "text.format",
        code="unsupported_parameter",
    )


# The chat path names chat's fields in its errors; a Responses client sent these instead.
_RENAMED = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def translated(exc: OpenAIError) -> OpenAIError:
    """`exc` with the chat field names in its message and `param` replaced by the
    Responses fields they came from."""
    message, param = exc.message, exc.param
    for chat_name, name in _RENAMED:
        message = message.replace(f"`{chat_name}", f"`{name}")
        if param == chat_name:
            param = name
    return replace(exc, message=message, param=param)


@dataclass(frozen=True)
class ResponsesPlan(OutputPlan):
    """The chat request's output plan plus what the response object repeats."""

    echo: ResponseEcho = field(default_factory=lambda: ResponseEcho())


async def prepare_response(
    preprocessor: Preprocessor, req: ResponsesChatRequest, request_id: str
) -> Prepared:
    """Prepare exactly as /v1/chat/completions does (errors renamed to the Responses
    fields); the plan carries the echo to `responses_formatter`."""
    try:
        prepared = await preprocessor.prepare_chat(req, request_id)
    except OpenAIError as exc:
        raise translated(exc) from None
    return Prepared(request=prepared.request, plan=_with_echo(prepared.plan, req.response_echo))


def _with_echo(plan: OutputPlan, echo: ResponseEcho) -> ResponsesPlan:
    # The plan is how per-request data reaches the formatter (`OpenAIEndpoint.formatter`
    # sees request id, model and plan), so the echo rides in a subclass of it: the
    # stdlib's shallow copy of a dataclass's fields, by their declared names.
    values = {f.name: getattr(plan, f.name) for f in fields(plan) if f.init}
    return ResponsesPlan(**values, echo=echo)


def _sse(event: StreamEvent, event_type: str) -> bytes:
    """A typed Server-Sent Event: `event:` names the type, as OpenAI sends them."""
    return b"event: " + event_type.encode() + b"\ndata: " + encode_json(event) + b"\n\n"


# --------------------------------------------------------------------------- formatter


def response_id(request_id: str) -> str:
    """`resp_<hex>` from the frontend's request id `resp-<hex>`: OpenAI's id shape."""
    return "resp_" + request_id.split("-", 1)[-1]


def _status(finish_reason: str | None) -> tuple[str, IncompleteDetails | None]:
    """Response status for a finish reason: `length` is OpenAI's `max_output_tokens`
    incompleteness; an engine abort is incomplete without a reason."""
    if finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if finish_reason == "abort":
        return "incomplete", IncompleteDetails(reason=None)
    return "completed", None


def _usage(usage: Usage) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.total_tokens,
    )


@dataclass(eq=False)
class ResponsesFormatter:
    """The `response` object of one request (`ResponseFormatter`), or its typed events.

    Streaming, the first `events` call opens the response (`response.created`,
    `response.in_progress`, the message item and its text part), every delta with text
    is one `response.output_text.delta`, the last delta closes the part and the item,
    and `usage_event` (the chat path asks for usage on every Responses stream) ends it
    with `response.completed` or `response.incomplete`. An engine failure reported in
    the stream, or a failure between batches, ends it with `response.failed`
    (`failure_event`); no `data: [DONE]` follows (`end_of_stream`)."""

    request_id: str
    model: str
    plan: OutputPlan
    echo: ResponseEcho | None = None  # None: a plain request's (`ResponseEcho()`)
    created: int | None = None  # None (or 0): now
    _id: str = field(init=False)  # the response's id, `resp_<hex>`
    _item_id: str = field(init=False)  # its one output message's, `msg_<hex>`
    _parts: list[str] = field(default_factory=list, init=False)
    _finish_reason: str | None = field(default=None, init=False)
    _sequence: int = field(default=0, init=False)
    _opened: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._id = response_id(self.request_id)
        self._item_id = "msg_" + self._id.removeprefix("resp_")
        self.echo = self.echo or ResponseEcho()
        self.created = self.created or int(time.time())

    # ------------------------------------------------------------------ streaming

    def events(self, delta: TextDelta) -> bytes:
        out = [] if self._opened else self._open()
        self._opened = True
        if delta.text:
            self._parts.append(delta.text)
            out.append(self._text_delta(delta.text))
        if delta.error is None and delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason
            out.extend(self._close())
        return b"".join(out)

    def usage_event(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        response = self._response(usage, metrics)
        if response.status == "incomplete":
            return _sse(ResponseIncomplete(self._next(), response), "response.incomplete")
        return _sse(ResponseCompleted(self._next(), response), "response.completed")

    def failure_event(self, error: OpenAIError) -> bytes:
        """`response.failed` with the text so far: the stream's last event."""
        opening = b"" if self._opened else b"".join(self._open())
        self._opened = True
        return opening + self._failed(error.message)

    def end_of_stream(self) -> bytes:
        """Nothing: `response.completed` (or `.incomplete`, `.failed`) ends a Responses
        stream, which has no `data: [DONE]` line (parsers that decode every event as JSON
        would choke on one)."""
        return b""

    # ------------------------------------------------------------------ unary

    def add(self, delta: TextDelta) -> None:
        if delta.text:
            self._parts.append(delta.text)
        if delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason

    def body(self, usage: Usage, metrics: PerRequestMetrics | None = None) -> bytes:
        return encode_json(self._response(usage, metrics))

    # ------------------------------------------------------------------ internals

    def _next(self) -> int:
        number = self._sequence
        self._sequence += 1
        return number

    def _open(self) -> list[bytes]:
        snapshot = self._snapshot("in_progress", [], None)
        item = OutputMessage(id=self._item_id, status="in_progress", content=[])
        return [
            _sse(ResponseCreated(self._next(), snapshot), "response.created"),
            _sse(ResponseInProgress(self._next(), snapshot), "response.in_progress"),
            _sse(OutputItemAdded(self._next(), 0, item), "response.output_item.added"),
            _sse(
                ContentPartAdded(self._next(), self._item_id, 0, 0, OutputText(text="")),
                "response.content_part.added",
            ),
        ]

    def _text_delta(self, text: str) -> bytes:
        event = OutputTextDelta(self._next(), self._item_id, 0, 0, delta=text)
        return _sse(event, "response.output_text.delta")

    def _close(self) -> list[bytes]:
        text = "".join(self._parts)
        item = self._message()
        return [
            _sse(
                OutputTextDone(self._next(), self._item_id, 0, 0, text=text),
                "response.output_text.done",
            ),
            _sse(
                ContentPartDone(self._next(), self._item_id, 0, 0, OutputText(text=text)),
                "response.content_part.done",
            ),
            _sse(OutputItemDone(self._next(), 0, item), "response.output_item.done"),
        ]

    def _failed(self, message: str) -> bytes:
        response = self._snapshot(
            "failed",
            [OutputMessage(self._item_id, "incomplete", [OutputText("".join(self._parts))])],
            None,
            error=ResponseError(code="server_error", message=message),
        )
        return _sse(ResponseFailed(self._next(), response), "response.failed")

    def _message(self) -> OutputMessage:
        status, _ = _status(self._finish_reason)
        return OutputMessage(
            id=self._item_id, status=status, content=[OutputText(text="".join(self._parts))]
        )

    def _response(self, usage: Usage, metrics: PerRequestMetrics | None) -> ResponseObject:
        status, incomplete = _status(self._finish_reason)
        return self._snapshot(
            status,
            [self._message()],
            _usage(usage),
            incomplete=incomplete,
            completed_at=int(time.time()),
            metrics=metrics,
        )

    def _snapshot(
        self,
        status: str,
        output: list[OutputMessage],
        usage: ResponseUsage | None,
        *,
        error: ResponseError | None = None,
        incomplete: IncompleteDetails | None = None,
        completed_at: int | None = None,
        metrics: PerRequestMetrics | None = None,
    ) -> ResponseObject:
        return ResponseObject(
            id=self._id,
            created_at=self.created,
            status=status,
            completed_at=completed_at,
            model=self.model,
            output=output,
            error=error,
            incomplete_details=incomplete,
            **self.echo.repeated(),
            tools=[],
            truncation="disabled",
            previous_response_id=None,
            reasoning=None,
            store=False,
            background=False,
            usage=usage,
            metrics=metrics,
        )


def responses_formatter(request_id: str, model: str, plan: OutputPlan) -> ResponsesFormatter:
    """The formatter for one /v1/responses request: its echo travels in the plan
    (`prepare_response`); a plain plan repeats nothing."""
    echo = plan.echo if isinstance(plan, ResponsesPlan) else None
    return ResponsesFormatter(request_id, model, plan, echo)
