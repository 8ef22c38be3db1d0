"""OpenAI request and response shapes as `msgspec.Struct`s.

Requests are decoded straight from the body bytes with these types: msgspec checks types
and range constraints in one pass and reports the JSON path of a bad field, which
`errors.from_validation_error` turns into a 400 naming that field. Unknown request fields
are ignored, as OpenAI clients send many we do not use.

Response structs keep OpenAI's exact field names; fields without a default are always
written (so `"finish_reason": null` appears in stream chunks, as clients expect), fields
with a default are left out while unset.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

# Every integer a request carries is bounded here, at decoding: the workers receive them
# in msgpack, which cannot carry integers beyond 64 bits, and vLLM keeps them in C types.
# Without the bounds, 2**64 in `seed` failed only when the request was sent (a 500).
INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

NonNegInt = Annotated[int, Meta(ge=0, le=INT32_MAX)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
# -1 and 0 disable top-k (vLLM's convention); the preprocessor rejects the other negatives.
TopK = Annotated[int, Meta(ge=-INT32_MAX - 1, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]  # vLLM's own bounds (a C long)

# --------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Optional flags accept an explicit JSON `null` (some clients send it for "unset"), so
    they are typed `X | None` and the preprocessor applies the default.
    """

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegInt | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    skip_special_tokens: bool | None = None  # vLLM extension; default True
    user: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt` is a string, a list of token ids, or a one-item list
    of either (multiple prompts are rejected: n=1 only)."""

    prompt: str | list[str | TokenId | list[TokenId]]
    logprobs: TopLogprobs | None = None
    echo: bool | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool | None = None  # default True
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


# `object` is written as a msgspec tag: always present, even with omit_defaults.
class Completion(msgspec.Struct, omit_defaults=True, tag_field="object", tag="text_completion"):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(msgspec.Struct):
    role: str
    content: str | None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, omit_defaults=True, tag_field="object", tag="chat.completion"):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(
    msgspec.Struct, omit_defaults=True, tag_field="object", tag="chat.completion.chunk"
):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelInfo(msgspec.Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "dynamo"


class ModelList(msgspec.Struct):
    data: list[ModelInfo]
    object: str = "list"
