"""The OpenAI generation routes as data: what differs between `/v1/completions`,
`/v1/chat/completions` and `/v1/responses` (request type, id prefix, preprocessing,
formatter, conversion), so that `HttpService` serves all three with one code path.

Separate from `server.py` because it is where the preprocessing and postprocessing stages
meet the route table: adding a route shape changes this table, not the server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from dynamo.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from dynamo.frontend.openai.responses_protocol import ResponsesRequest
from dynamo.frontend.postprocess.chat_formatter import ChatFormatter
from dynamo.frontend.postprocess.completion_formatter import CompletionFormatter
from dynamo.frontend.postprocess.formatters import ResponseFormatter
from dynamo.frontend.postprocess.responses_api import (
    prepare_response,
    responses_formatter,
    to_chat_request,
)
from dynamo.frontend.preprocess.preprocessor import OutputPlan, Prepared, Preprocessor


@dataclass(frozen=True)
class OpenAIEndpoint:
    """What differs between /v1/completions and /v1/chat/completions."""

    name: str  # the `endpoint` metrics label
    decoder: msgspec.json.Decoder
    id_prefix: str
    prepare: Callable[[Preprocessor, Any, str], Awaitable[Prepared]]
    formatter: Callable[[str, str, OutputPlan], ResponseFormatter]
    # The decoded request into the one served (/v1/responses: the chat request it means).
    convert: Callable[[Any], Any] | None = None


COMPLETIONS = OpenAIEndpoint(
    name="completions",
    decoder=msgspec.json.Decoder(CompletionRequest),
    id_prefix="cmpl",
    prepare=Preprocessor.prepare_completion,
    formatter=CompletionFormatter,
)
CHAT_COMPLETIONS = OpenAIEndpoint(
    name="chat_completions",
    decoder=msgspec.json.Decoder(ChatCompletionRequest),
    id_prefix="chatcmpl",
    prepare=Preprocessor.prepare_chat,
    formatter=ChatFormatter,
)
# A thin layer over chat completions (`responses_api.py`): same path, other shape.
RESPONSES = OpenAIEndpoint(
    name="responses",
    decoder=msgspec.json.Decoder(ResponsesRequest),
    id_prefix="resp",
    prepare=prepare_response,
    formatter=responses_formatter,
    convert=to_chat_request,
)
