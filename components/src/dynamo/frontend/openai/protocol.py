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

from typing import Annotated, Any, Generic, TypeVar

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
Priority = Annotated[int, Meta(ge=-INT32_MAX - 1, le=INT32_MAX)]

# --------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    """`response_format.json_schema`: OpenAI's named schema (`schema` is a Python name)."""

    name: str
    description: str | None = None
    schema_: Any = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`response_format`: `text`, `json_object` or `json_schema` (checked by
    `structured_output`, which names the unsupported types)."""

    type: str
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs` extension (sent through the OpenAI client's
    `extra_body`): one constraint plus its whitespace options."""

    json: Any = None  # a schema object or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


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
    # Dynamo's extension: per-request speculative decoding statistics in the response.
    return_spec_stats: bool | None = None
    # Dynamo's extension: `false` turns the worker's speculative decoding off for this
    # request (no drafts are verified for it); unset or `true`: the worker's setting.
    speculative_decoding: bool | None = None
    # OpenAI's: token id (as a string key) -> bias; vLLM's extensions restrict or forbid.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # vLLM's extensions served by the frontend itself (tokenization and the response).
    include_stop_str_in_output: bool | None = None  # the stop string stays in the text
    truncate_prompt_tokens: int | None = None  # see `truncation`
    truncation_side: str | None = None  # "left" (default) or "right"
    add_special_tokens: bool | None = None  # default: true for completions, false for chat
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"
    return_token_ids: bool | None = None  # prompt and output token ids in the response
    thinking_token_budget: int | None = None  # -1: unlimited; the worker's engine applies it
    # vLLM's: lower is served sooner (default 0). Orders the frontend's busy queue, and
    # the worker's vLLM scheduler when it runs `--scheduling-policy priority`.
    priority: Priority | None = None
    # Fields declared only so that a value we do not serve is refused with a 400 naming
    # it instead of being ignored (`unsupported_fields.SUPPORT` says which values).
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # Structured output (see `structured_output`): OpenAI's field, vLLM's extension, and
    # the older `guided_*` extensions vLLM 0.32 dropped but clients still send.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt` is a string, a list of token ids, or a one-item list
    of either (multiple prompts are rejected: n=1 only)."""

    prompt: str | list[str | TokenId | list[TokenId]]
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    # Declared to be refused (see `unsupported_fields`).
    best_of: PositiveInt | None = None
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`tools[i].function`: what the model may call (checked by `tool_calls`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments object
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of `tools`; only `function` tools exist in the chat API."""

    type: str
    function: FunctionDefinition


class ToolChoiceName(msgspec.Struct, kw_only=True):
    name: str


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    """`tool_choice` naming one function: `{"type": "function", "function": {"name": ...}}`."""

    type: str
    function: ToolChoiceName


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
    # Accepted, no effect on the output (see `unsupported_fields`).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Tool calling (see `tool_calls`).
    tools: list[ToolDefinition] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    # Declared to be refused unless neutral (see `unsupported_fields`).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    chat_template: str | None = None
    # For the chat template, as vLLM passes them (see `preprocessor`).
    reasoning_effort: str | None = None
    documents: list[dict[str, str]] | None = None
    echo: bool | None = None  # the last message, when the assistant's, starts the reply
    include_reasoning: bool | None = None


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpeculativeDecodingMetrics(msgspec.Struct, omit_defaults=True):
    """One request's speculative decoding statistics, from the engine's own counters.

    vLLM's per-request shape (`metrics.speculative_decoding` of its responses), so tools
    written for it read ours; `acceptance_per_position` is Dynamo's addition: draft
    tokens accepted at each draft position, what vLLM's
    `vllm:spec_decode_num_accepted_tokens_per_pos` counter counts over all requests."""

    mean_acceptance_length: float  # tokens per verification step, bonus token included
    draft_acceptance_rate: float  # accepted / drafted
    acceptance_histogram: list[int]  # [j]: steps that accepted exactly j draft tokens
    num_spec_steps: int  # verification steps that carried drafts (`num_drafts`)
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int  # K, the most draft tokens per step
    acceptance_per_position: list[int]


class PerRequestMetrics(msgspec.Struct, omit_defaults=True):
    """vLLM's `metrics` response field; only `speculative_decoding` is filled here."""

    speculative_decoding: SpeculativeDecodingMetrics | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    # null at an echoed prompt's first token, which nothing predicts (as vLLM sends it)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """One entry of vLLM's `prompt_logprobs` (keyed by token id in the response)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's `prompt_logprobs` field: per prompt position, token id -> entry; null first.
PromptLogprobsField = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # `return_token_ids` (vLLM's): the prompt's ids (first chunk of a stream) and the
    # choice's generated ids (each chunk's own).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsField | None = None  # vLLM's, unstreamed


Choice = TypeVar("Choice")


class ResponseEnvelope(msgspec.Struct, Generic[Choice], omit_defaults=True):
    """What the completion and chat response objects (and chat's stream chunks) start
    with, in this order: the response's identity, its choices, usage and metrics. Each
    subclass names its `object` as a msgspec tag: always present, even with omit_defaults."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    metrics: PerRequestMetrics | None = None  # `return_spec_stats`; beside usage


# The /v1/completions response object and stream chunk (no docstring: it would become
# the OpenAPI schema's description).
class Completion(ResponseEnvelope[CompletionChoice], tag_field="object", tag="text_completion"):
    pass


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


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    reasoning_content: str | None = None  # vLLM's extension: a reasoning model's thinking
    tool_calls: list[ToolCall] = []


class ChatChoice(msgspec.Struct, omit_defaults=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # `return_token_ids`


class ChatCompletion(ResponseEnvelope[ChatChoice], tag_field="object", tag="chat.completion"):
    prompt_token_ids: list[int] | None = None  # `return_token_ids`
    prompt_logprobs: PromptLogprobsField | None = None  # vLLM's


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    """One streamed piece of a tool call: `id`, `type` and the name on its first piece."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(msgspec.Struct, omit_defaults=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # `return_token_ids`: this chunk's


class ChatCompletionChunk(
    ResponseEnvelope[ChatChunkChoice], tag_field="object", tag="chat.completion.chunk"
):
    prompt_token_ids: list[int] | None = None  # `return_token_ids`: the first chunk's


class ModelInfo(msgspec.Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "dynamo"


class ModelList(msgspec.Struct):
    data: list[ModelInfo]
    object: str = "list"
