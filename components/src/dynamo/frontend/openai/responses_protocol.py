"""The wire types of OpenAI's Responses API (`POST /v1/responses`) as this frontend
serves it: the request it decodes (with the fields declared only so that a value it
does not serve is refused) and the response object and stream events it encodes. The
endpoint's logic (conversion to a chat request, the formatter) is `responses_api`."""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo.frontend.openai.protocol import (
    PerRequestMetrics,
    PositiveInt,
    Probability,
    Temperature,
)

# --------------------------------------------------------------------------- requests


class InputContentPart(msgspec.Struct, kw_only=True):
    """One part of an input message's content; only the text parts are served."""

    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`. Only messages are served; `type` and `role` are checked by
    `to_chat_request`, which names the unsupported item instead of a missing field."""

    type: str | None = None  # "message" or absent (the "easy" input message)
    role: str | None = None
    content: str | list[InputContentPart] | None = None
    id: str | None = None  # output messages sent back as history carry these two
    status: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    """`text.format`: `text`, `json_object`, or `json_schema` with the schema inline
    (flat, unlike chat's `response_format.json_schema`)."""

    type: str
    name: str | None = None
    description: str | None = None
    schema_: Any = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused unless null: no verbosity control


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses: the subset we serve, the fields accepted without effect, and
    the fields declared only so that a value we do not serve is refused
    (`unsupported_fields.SUPPORT`)."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stream: bool | None = None
    text: TextConfig | None = None
    # Dynamo's extension: per-request speculative decoding statistics (`metrics`).
    return_spec_stats: bool | None = None
    # Dynamo's extension: `false` turns the worker's speculation off for this request.
    speculative_decoding: bool | None = None
    # Accepted, no effect on the output.
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # nothing is ever stored
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    parallel_tool_calls: bool | None = None
    stream_options: dict[str, Any] | None = None
    # Refused unless neutral (see `unsupported_fields.SUPPORT`).
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    max_tool_calls: int | None = None
    reasoning: Any = None
    include: list[str] | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    truncation: str | None = None
    context_management: Any = None


# --------------------------------------------------------------------------- response objects


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str  # in_progress, completed, incomplete
    content: list[OutputText]
    role: str = "assistant"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str | None


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, omit_defaults=True, tag_field="object", tag="response"):
    """The `response` object. Every field but `metrics` is always written (`null` where
    unset), as OpenAI writes them; `metrics` (Dynamo's `return_spec_stats`) only when
    asked for."""

    id: str
    created_at: int
    status: str  # in_progress, completed, incomplete, failed
    completed_at: int | None
    model: str
    output: list[OutputMessage]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    parallel_tool_calls: bool
    tool_choice: str
    tools: list[Any]
    text: dict[str, Any]
    truncation: str
    metadata: dict[str, str]
    user: str | None
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    store: bool  # always false: nothing is stored
    background: bool
    usage: ResponseUsage | None
    metrics: PerRequestMetrics | None = None


class StreamEvent(msgspec.Struct, tag_field="type"):
    sequence_number: int


class ResponseEvent(StreamEvent):
    """A step of the response's lifecycle, carrying the response object as it stands."""

    response: ResponseObject


class ResponseCreated(ResponseEvent, tag="response.created"): ...


class ResponseInProgress(ResponseEvent, tag="response.in_progress"): ...


class ResponseCompleted(ResponseEvent, tag="response.completed"): ...


class ResponseIncomplete(ResponseEvent, tag="response.incomplete"): ...


class ResponseFailed(ResponseEvent, tag="response.failed"): ...


class OutputItemEvent(StreamEvent):
    """An output item (the message) opened or closed."""

    output_index: int
    item: OutputMessage


class OutputItemAdded(OutputItemEvent, tag="response.output_item.added"): ...


class OutputItemDone(OutputItemEvent, tag="response.output_item.done"): ...


class ContentEvent(StreamEvent):
    """An event about one content part of one output item."""

    item_id: str
    output_index: int
    content_index: int


class ContentPartEvent(ContentEvent):
    """A content part opened or closed (with its text so far)."""

    part: OutputText


class ContentPartAdded(ContentPartEvent, tag="response.content_part.added"): ...


class ContentPartDone(ContentPartEvent, tag="response.content_part.done"): ...


class OutputTextDelta(ContentEvent, tag="response.output_text.delta"):
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(ContentEvent, tag="response.output_text.done"):
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
