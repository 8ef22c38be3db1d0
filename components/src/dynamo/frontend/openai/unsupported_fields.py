"""Which OpenAI (and vLLM-extension) request fields the frontend serves, and the 400 for
those it does not.

Before this module, a request with `tools`, `logit_bias` or `suffix` got a 200 with text
that ignored them: msgspec drops fields a struct does not declare. A client (an agent
framework, an extraction job) then failed far from the cause. Now every field of OpenAI's
`chat.completions.create` / `completions.create` and the vLLM extensions clients pass
through `extra_body` is declared on the request structs (`openai/protocol.py`), and
`SUPPORT` below says, per field, whether it is

* `honoured`: served (the preprocessor or the worker acts on it);
* `accepted`: taken and ignored because it cannot change the output here (`user`,
  `metadata`, `store`, `service_tier`, ...);
* `refused`: a value other than the neutral one (`null`, `false`, empty, `n` = 1, ...)
  is a 400 whose `param` names the field.

Fields outside this table are not OpenAI's nor a known vLLM extension: they stay ignored,
as `vllm serve` ignores them, and one debug log line lists them (`log_unknown_fields`).

`SUPPORT` is the single source of truth: the refusal check reads it, the support table in
docs/frontend.md is checked against it by a unit test, and the same test sends every field.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from dynamo.frontend.openai.errors import OpenAIError, bad_request
from dynamo.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


class Support(StrEnum):
    HONOURED = "honoured"
    ACCEPTED = "accepted"  # taken, no effect on the output
    REFUSED = "refused"  # 400 unless the value is neutral


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"


BOTH = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
"""Chat and completions: the Responses endpoint lists only what it refuses (its request
is converted into a chat request, and the chat path serves the rest)."""
CHAT = frozenset({Endpoint.CHAT})
COMPLETIONS = frozenset({Endpoint.COMPLETIONS})
RESPONSES = frozenset({Endpoint.RESPONSES})


def _unset(value: Any) -> bool:
    """Neutral: absent, null, false or empty (what a client sends for "not used")."""
    return value is None or value is False or value == "" or value == [] or value == {}


def _is_none(value: Any) -> bool:
    return value is None


def _at_most_one(value: Any) -> bool:
    return value is None or value == 1


def _tool_choice_none(value: Any) -> bool:
    return _unset(value) or value == "none"


def _text_only(value: Any) -> bool:
    return _unset(value) or value == ["text"]


def _true_or_unset(value: Any) -> bool:
    return value is None or value is True


def _no_tool_choice(value: Any) -> bool:
    return value is None or value in ("none", "auto")


def _no_reasoning(value: Any) -> bool:
    """Clients send `reasoning: {}` or `{"effort": null}` for "no reasoning options"."""
    return value is None or (isinstance(value, dict) and all(v is None for v in value.values()))


def _no_truncation(value: Any) -> bool:
    return value is None or value == "disabled"


def _no_logprobs(value: Any) -> bool:
    return value is None or value == 0


@dataclass(frozen=True)
class FieldSupport:
    """How one request field is served. `neutral(value)` is True for the values a refused
    field may still carry (they change nothing)."""

    name: str
    endpoints: frozenset[Endpoint]
    support: Support
    note: str
    neutral: Callable[[Any], bool] = _unset
    vllm_extension: bool = False

    @property
    def endpoint_label(self) -> str:
        return "both" if self.endpoints == BOTH else next(iter(self.endpoints)).value


H, A, R = Support.HONOURED, Support.ACCEPTED, Support.REFUSED


def _openai(
    name: str,
    support: Support,
    note: str,
    endpoints: frozenset[Endpoint] = BOTH,
    neutral: Callable[[Any], bool] = _unset,
    *,
    vllm_extension: bool = False,
) -> FieldSupport:
    """A row of the table: an OpenAI field (both endpoints unless `endpoints` says)."""
    return FieldSupport(name, endpoints, support, note, neutral, vllm_extension)


_vllm = functools.partial(_openai, vllm_extension=True)
"""A row of the table for a vLLM extension (`_openai`'s arguments)."""


SUPPORT: tuple[FieldSupport, ...] = (
    # ------------------------------------------------------------------ OpenAI fields
    _openai("model", H, "the served model name"),
    _openai("messages", H, "text content; the model's chat template", CHAT),
    _openai("prompt", H, "a string, token ids, or a one-item list of either", COMPLETIONS),
    _openai("stream", H, "Server-Sent Events"),
    _openai("stream_options", H, "`include_usage`"),
    _openai("max_tokens", H, "bounded by the context length"),
    _openai("max_completion_tokens", H, "wins over `max_tokens`", CHAT),
    _openai("temperature", H, "0..2"),
    _openai("top_p", H, "0..1"),
    _openai("seed", H, "a 64-bit integer"),
    _openai("stop", H, "up to 4 strings; not part of the text unless `include_stop_str_in_output`"),
    _openai("presence_penalty", H, "-2..2"),
    _openai("frequency_penalty", H, "-2..2"),
    _openai("logprobs", H, "chat: boolean; completions: 0..20 alternatives"),
    _openai("top_logprobs", H, "0..20; needs `logprobs`", CHAT),
    _openai("echo", H, "the prompt before the completion", COMPLETIONS),
    _openai("response_format", H, "see Structured output"),
    _openai("user", A, "no effect on the output"),
    _openai("metadata", A, "nothing is stored", CHAT),
    _openai("store", A, "nothing is stored; `store: true` is accepted and not kept", CHAT),
    _openai("service_tier", A, "one tier here", CHAT),
    _openai("safety_identifier", A, "no effect on the output", CHAT),
    _openai("prompt_cache_key", A, "prefix caching is automatic (KV router)", CHAT),
    _openai("prompt_cache_retention", A, "prefix caching is automatic", CHAT),
    _openai("prompt_cache_options", A, "prefix caching is automatic", CHAT),
    _openai("tools", H, "see Tool calling", CHAT),
    _openai("tool_choice", H, "`none`, `auto`, `required`, a named function", CHAT),
    _openai("parallel_tool_calls", H, "`false`: at most one call", CHAT),
    _openai("n", H, "1..16 choices, sampled in parallel on one worker; see Several choices"),
    _openai(
        "best_of",
        R,
        "only 1: vLLM's V1 engine removed `best_of`; use `n` and rank the choices",
        COMPLETIONS,
        neutral=_at_most_one,
    ),
    _openai("suffix", R, "no insertion mode (vllm serve refuses it too)", COMPLETIONS),
    _openai(
        "logit_bias",
        H,
        "token id -> bias, clamped to [-100, 100]; a worker that speculates refuses it (400): "
        "vLLM applies no logit_bias then",
    ),
    _openai("functions", R, "deprecated; send `tools`", CHAT),
    _openai("function_call", R, "deprecated; send `tool_choice`", CHAT, neutral=_tool_choice_none),
    _openai("audio", R, "text models only", CHAT, neutral=_is_none),
    _openai("modalities", R, '`["text"]` is accepted', CHAT, neutral=_text_only),
    _openai("prediction", R, "predicted outputs are not implemented", CHAT, neutral=_is_none),
    _openai("web_search_options", R, "no web search", CHAT, neutral=_is_none),
    _openai(
        "reasoning_effort",
        H,
        "passed to the chat template, with `enable_thinking` (false for `none`) unless "
        "`chat_template_kwargs` sets it",
        CHAT,
    ),
    _openai("verbosity", R, "no verbosity control", CHAT),
    _openai("moderation", R, "no moderation", CHAT, neutral=_is_none),
    # ------------------------------------------------------------------ vLLM extensions
    _vllm("top_k", H, "-1 or 0 disable it"),
    _vllm(
        "min_p",
        H,
        "0..1; a worker that speculates refuses it (400): vLLM applies no min_p then",
    ),
    _vllm("repetition_penalty", H, "(0, 2]"),
    _vllm("stop_token_ids", H, "hidden from the text"),
    _vllm("ignore_eos", H, "keeps going past EOS"),
    _vllm("min_tokens", H, "EOS and stops suppressed before"),
    _vllm("skip_special_tokens", H, "default true"),
    _vllm("add_generation_prompt", H, "default true", CHAT),
    _vllm("continue_final_message", H, "continues the last assistant message", CHAT),
    _vllm("chat_template_kwargs", H, "only the template's own variables", CHAT),
    _vllm("structured_outputs", H, "see Structured output"),
    _vllm("guided_json", H, "older name; see Structured output"),
    _vllm("guided_regex", H, "older name; see Structured output"),
    _vllm("guided_choice", H, "older name; see Structured output"),
    _vllm("guided_grammar", H, "older name; see Structured output"),
    _vllm("guided_whitespace_pattern", H, "older name; see Structured output"),
    _vllm("return_spec_stats", H, "per-request speculation statistics (Dynamo)"),
    _vllm("speculative_decoding", H, "`false`: no drafts for this request (Dynamo)"),
    _vllm(
        "priority",
        H,
        "lower is served sooner (default 0; the X-Vllm-Priority header wins): orders the "
        "busy queue, and vLLM's scheduler on a worker run with --scheduling-policy priority",
    ),
    _vllm(
        "use_beam_search",
        H,
        "`n` beams, searched by the frontend as vLLM's server does; fields the search "
        "ignores are refused",
    ),
    _vllm("length_penalty", H, "beam search only (a value other than 1 without it: 400)"),
    _vllm(
        "include_stop_str_in_output",
        H,
        "the stop string (or stop token's text) ends the text; the first stop to complete wins",
    ),
    _vllm(
        "spaces_between_special_tokens",
        R,
        "`true` is accepted; the detokenizer keeps the tokenizer's own spacing",
        neutral=_true_or_unset,
    ),
    _vllm(
        "truncate_prompt_tokens",
        H,
        "keep N prompt tokens (after the chat template); -1: the context less one token",
    ),
    _vllm("truncation_side", H, "`left` (default) keeps the prompt's end, `right` its start"),
    _vllm(
        "prompt_logprobs",
        H,
        "-1 or N >= 0 per prompt token, unstreamed (0 streams); from the prefill worker "
        "when disaggregated",
    ),
    _vllm(
        "logprob_token_ids",
        H,
        "these tokens' logprobs at each position (needs `logprobs`); a worker that "
        "speculates refuses it (400): vLLM reports them misaligned then",
    ),
    _vllm("allowed_token_ids", H, "only these token ids are sampled; also while speculating"),
    _vllm("bad_words", H, "words the output never contains; also while speculating"),
    _vllm("add_special_tokens", H, "default true for completions, false for chat"),
    _vllm("echo", H, "the last message, when the assistant's, starts the reply", CHAT),
    _vllm("documents", H, "passed to the chat template (RAG templates)", CHAT),
    _vllm(
        "chat_template",
        R,
        "for safety: a request's Jinja template would run in the frontend (vllm serve "
        "refuses it too unless started with --trust-request-chat-template)",
        CHAT,
    ),
    _vllm("logits_processors", R, "for safety: no request loads Python code here"),
    _vllm(
        "thinking_token_budget",
        H,
        "-1: unlimited; applied by a worker started with vLLM's --reasoning-config, "
        "refused (400, vLLM's words) by one without",
    ),
    _vllm("include_reasoning", H, "false drops `reasoning_content` (--reasoning-parser)", CHAT),
    _vllm("return_tokens_as_token_ids", H, 'logprob tokens named "token_id:N"'),
    _vllm("return_token_ids", H, "`prompt_token_ids` and each choice's `token_ids`"),
    _vllm("prompt_embeds", R, "no engine here takes embeddings", COMPLETIONS),
    _vllm("vllm_xargs", R, "they reach only custom logits processors, which are not loaded"),
    # ------------------------------------------------------------------ /v1/responses
    _openai("previous_response_id", R, "nothing is stored: send the whole history", RESPONSES),
    _openai("conversation", R, "nothing is stored: send the whole history", RESPONSES),
    _openai("background", R, "no background responses: nothing is stored", RESPONSES),
    _openai("tools", R, "no tools through /v1/responses; use /v1/chat/completions", RESPONSES),
    _openai("tool_choice", R, "`none` and `auto` are accepted", RESPONSES, neutral=_no_tool_choice),
    _openai("max_tool_calls", R, "no tools through /v1/responses", RESPONSES, neutral=_is_none),
    _openai("reasoning", R, "no reasoning controls", RESPONSES, neutral=_no_reasoning),
    _openai("include", R, "no extra output data", RESPONSES),
    _openai("prompt", R, "no stored prompt templates", RESPONSES, neutral=_is_none),
    _openai(
        "top_logprobs", R, "no logprobs through /v1/responses", RESPONSES, neutral=_no_logprobs
    ),
    _openai(
        "truncation",
        R,
        "input is never truncated; `disabled` is accepted",
        RESPONSES,
        neutral=_no_truncation,
    ),
    _openai("context_management", R, "no context compaction", RESPONSES),
)


def fields_for(endpoint: Endpoint, support: Support | None = None) -> list[FieldSupport]:
    """The table's entries for `endpoint` (optionally only those of one `support`)."""
    return [
        entry
        for entry in SUPPORT
        if endpoint in entry.endpoints and (support is None or entry.support is support)
    ]


def _refusable_names(endpoint: Endpoint) -> tuple[FieldSupport, ...]:
    return tuple(fields_for(endpoint, Support.REFUSED))


_REFUSED = {endpoint: _refusable_names(endpoint) for endpoint in Endpoint}


def refuse_unserved(request: msgspec.Struct, endpoint: Endpoint) -> None:
    """400 naming the first field `request` sets to a value we do not serve.

    Reads the decoded struct once as a mapping (`asdict` is shallow: a few microseconds),
    so no field is read by name through attribute tricks."""
    values = msgspec.structs.asdict(request)
    for entry in _REFUSED[endpoint]:
        if not entry.neutral(values.get(entry.name)):
            raise unsupported(entry.name, entry.note)


def unsupported(name: str, why: str) -> OpenAIError:
    """The 400 for a field `name` set to a value this server does not serve, and `why`."""
    return bad_request(
        f"`{name}` is not supported by this server ({why}).",
        param=name,
        code="unsupported_parameter",
    )


def check_request(request: object) -> None:
    """`refuse_unserved` for a decoded chat or completion request; other types pass."""
    if isinstance(request, ChatCompletionRequest):
        refuse_unserved(request, Endpoint.CHAT)
    elif isinstance(request, CompletionRequest):
        refuse_unserved(request, Endpoint.COMPLETIONS)


_MAX_NAMES_LOGGED = 20
_MAX_NAME_CHARS = 64
_KEYS_DECODER = msgspec.json.Decoder(dict[str, msgspec.Raw])


def unknown_fields(body: bytes, known: Iterable[str]) -> list[str]:
    """Top-level keys of `body` that are not in `known` (values are not decoded)."""
    try:
        keys = _KEYS_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return []
    known_set = set(known)
    return sorted(key for key in keys if key not in known_set)


def log_unknown_fields(body: bytes, request_type: type[msgspec.Struct]) -> None:
    """One debug line listing the fields of `body` that `request_type` ignores. The body is
    scanned a second time, so only when debug logging is on."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    names = unknown_fields(body, request_type.__struct_fields__)
    if names:
        # Names only (never values, which may hold secrets), bounded: a client picks them.
        shown = [name[:_MAX_NAME_CHARS] for name in names[:_MAX_NAMES_LOGGED]]
        more = len(names) - len(shown)
        suffix = f" (and {more} more)" if more else ""
        log.debug("ignored unknown request fields: %s%s", ", ".join(shown), suffix)
