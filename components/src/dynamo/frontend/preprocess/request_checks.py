"""The rules of a chat or completion request's sampling and output fields, as vLLM
applies them, checked in the frontend so that a bad request is a 400 naming its field
before any worker sees it: choices, stops, token ids against the vocabulary, logprobs,
beam search, the context length; and the fields as the worker takes them (defaults from
the model's card, `logit_bias` by token id)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from dynamo.frontend.engine.beam_search import BeamSearch
from dynamo.frontend.openai.errors import bad_request
from dynamo.frontend.openai.limits import (
    check_buffered_prompt_logprobs,
    check_stop,
    context_exceeded,
)
from dynamo.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from dynamo.frontend.preprocess.structured_output import (
    carries_constraint,
    constraint_pool,
    structured_output_of,
)
from dynamo.frontend.preprocess.tools import ToolRequest, tool_request
from dynamo.llm.protocols import SamplingDefaults, SamplingOptions, StructuredOutput

# The largest `n` served: each choice is a full sequence on the worker (its own decode KV
# blocks and batch slot), so one request may not occupy more than this many.
MAX_CHOICES = 16
# vLLM's bound on `logprob_token_ids` (its `MAX_LOGPROB_TOKEN_IDS`).
MAX_LOGPROB_TOKEN_IDS = 128
# Request fields vLLM's beam search does not read (it samples each step with the
# temperature only): refused with it rather than ignored.
BEAM_SEARCH_IGNORES = frozenset(
    {
        "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
        "allowed_token_ids", "bad_words", "prompt_logprobs", "echo",
    }
)  # fmt: skip


LOGIT_BIAS_BOUND = 100.0
"""vLLM clamps each bias to [-100, 100] (OpenAI's documented range)."""


def logit_bias_by_token(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as string keys) as vLLM takes it: integer keys,
    each bias clamped to [-100, 100], as `vllm serve` does; a key that is not a token id
    is the client's error (400, naming the field). None or empty: no bias."""
    if not bias:
        return None
    by_token: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0:
            raise bad_request(
                f"`logit_bias` keys must be token ids (non-negative integers), got {key!r}",
                "logit_bias",
            )
        by_token[token] = min(LOGIT_BIAS_BOUND, max(-LOGIT_BIAS_BOUND, value))
    return by_token


def check_sampling_fields(req: SamplingFields) -> None:
    """The sampling fields' own rules (vLLM's), before anything about the model."""
    check_stop(req.stop)
    budget = req.thinking_token_budget
    if budget is not None and budget < -1:
        raise bad_request(
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
            "thinking_token_budget",
        )
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise bad_request("`allowed_token_ids` must not be empty", "allowed_token_ids")
    if req.bad_words is not None and not all(req.bad_words):
        raise bad_request("`bad_words` cannot contain an empty string", "bad_words")
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"`n` must be between 1 and {MAX_CHOICES}, got {req.n}", "n")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request("`top_k` must be -1 (disabled), 0 (disabled) or positive", "top_k")


def sampling_options(
    req: SamplingFields,
    defaults: SamplingDefaults | None,
    logit_bias: dict[int, float] | None,
) -> SamplingOptions:
    """The request's sampling fields; one it leaves unset (None) takes the model's default
    from the card (its generation_config.json), as `vllm serve` does. An explicit value,
    0 included, always wins."""
    values = {name: getattr(req, name) for name in SamplingOptions.__struct_fields__}
    values["logit_bias"] = logit_bias  # by token id (`logit_bias_by_token`), not as sent
    if values["thinking_token_budget"] == -1:
        values["thinking_token_budget"] = None  # vLLM's "unlimited"
    if defaults is not None:
        for name, value in values.items():
            if value is None and name in SamplingDefaults.__struct_fields__:
                values[name] = getattr(defaults, name)
    return SamplingOptions(**{k: v for k, v in values.items() if v is not None})


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    return tuple(dict.fromkeys(s for s in items if s))


def checked_beam_search(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    structured_output: StructuredOutput | None,
    defaults: SamplingDefaults | None,
) -> BeamSearch | None:
    """vLLM's beam search for a request that asks for it (`n` beams). vLLM's search
    reads only `n`, `max_tokens`, `temperature`, `length_penalty`, `ignore_eos`,
    `include_stop_str_in_output` and `skip_special_tokens` and ignores the rest; here
    a field it would ignore is a 400 naming it, nothing is silently dropped."""
    if not req.use_beam_search:
        if req.length_penalty not in (None, 1.0):
            raise bad_request(
                "`length_penalty` applies to beam search only (`use_beam_search`)",
                "length_penalty",
            )
        return None
    if req.logprob_token_ids:
        raise bad_request(
            "`logprob_token_ids` is not supported with beam search.", "logprob_token_ids"
        )
    ignored = [
        name
        for name, value in msgspec.structs.asdict(req).items()
        if name in BEAM_SEARCH_IGNORES and value not in (None, False, [], {}, "")
    ]
    if logprobs is not None:
        ignored.insert(0, "logprobs")
    if structured_output is not None:
        ignored.insert(0, "structured output")
    if ignored:
        raise bad_request(
            f"`{ignored[0]}` is not applied with beam search (vLLM's beam search reads "
            "only n, max_tokens, temperature, length_penalty, ignore_eos, "
            "include_stop_str_in_output and skip_special_tokens)",
            ignored[0],
        )
    if max_tokens is None:
        raise bad_request("beam search needs `max_tokens`", "max_tokens")
    temperature = req.temperature
    if temperature is None:
        default = defaults.temperature if defaults is not None else None
        temperature = 1.0 if default is None else default  # vLLM's default
    return BeamSearch(
        width=req.n or 1,
        max_tokens=max_tokens,
        temperature=temperature,
        length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
    )


def checked_logprob_token_ids(
    req: SamplingFields, logprobs: int | None, vocab_size: int
) -> tuple[int, ...]:
    """vLLM's `logprob_token_ids` (empty: not asked) and its rules: `logprobs` asked
    for, at most `MAX_LOGPROB_TOKEN_IDS` ids, each in the vocabulary."""
    ids = tuple(req.logprob_token_ids or ())
    if not ids:
        return ()
    if logprobs is None:
        needs = "set to true" if isinstance(req, ChatCompletionRequest) else "set"
        raise bad_request(
            f"when using `logprob_token_ids`, `logprobs` must be {needs}.",
            "logprob_token_ids",
        )
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise bad_request(
            f"Requested logprob_token_ids of length {len(ids)}, which is greater than "
            f"max allowed: {MAX_LOGPROB_TOKEN_IDS}",
            "logprob_token_ids",
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"token_id(s) {bad[:8]} in logprob_token_ids contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}",
            "logprob_token_ids",
        )
    return ids


def checked_prompt_logprobs(
    req: SamplingFields, prompt_len: int, logprobs: int | None, vocab_size: int
) -> int | None:
    """vLLM's `prompt_logprobs` and its rules: at least -1 (the whole vocabulary), not
    in a stream unless 0; `echo` with logprobs asks for as many as `logprobs`. The
    response holds them whole, so they count against `MAX_BUFFERED_LOGPROBS`."""
    asked = req.prompt_logprobs
    if asked is None:
        if not req.echo:
            return None
        # vLLM reports the echoed prompt's logprobs: as many alternatives as the
        # completion's `logprobs`, or chat's `top_logprobs` (its default there: 0).
        if isinstance(req, ChatCompletionRequest):
            asked = req.top_logprobs or 0
        elif logprobs is None:
            return None
        else:
            asked = logprobs
    elif asked < -1:
        raise bad_request("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    elif req.stream and asked != 0:
        raise bad_request(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    check_buffered_prompt_logprobs(prompt_len, vocab_size if asked == -1 else asked)
    return asked


def check_in_vocabulary(token_ids: Iterable[int], field: str, vocab_size: int) -> None:
    """400 naming `field` for the first token id outside the tokenizer's vocabulary
    (vLLM refuses the same ids, but only once the request reached a worker)."""
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} in `{field}` is outside the vocabulary", field)


def checked_max_tokens(
    prompt_len: int,
    max_tokens: int | None,
    param: str,
    prompt_param: str,
    *,
    context_length: int,
    defaults: SamplingDefaults | None,
) -> int | None:
    """Enforce prompt + max_tokens <= context length; default to the model's default
    (generation_config's `max_new_tokens`) capped by the rest of the context, as
    `vllm serve` does."""
    ctx = context_length
    default = defaults.max_tokens if defaults is not None else None
    if ctx <= 0:  # the worker did not advertise one: let it decide
        return max_tokens if max_tokens is not None else default
    if prompt_len >= ctx:
        raise context_exceeded(ctx, prompt_len, prompt_param)
    if max_tokens is None:
        return ctx - prompt_len if default is None else min(default, ctx - prompt_len)
    if prompt_len + max_tokens > ctx:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens, but {prompt_len + max_tokens} "
            f"were requested ({prompt_len} in the prompt, {max_tokens} for the completion). "
            f"Reduce `{param}` to at most {ctx - prompt_len}.",
            param,
            code="context_length_exceeded",
        )
    return max_tokens


@dataclass(frozen=True)
class CheckedConstraints:
    """A request's output constraint and tools, checked (schemas against their
    meta-schemas): the part of preparing a request whose cost the client chooses."""

    output: StructuredOutput | None
    tools: ToolRequest | None


def checked_constraints(req: CompletionRequest | ChatCompletionRequest) -> CheckedConstraints:
    """`req`'s constraint and (chat) tools, checked; a 400 naming the field at fault."""
    tools = tool_request(req) if isinstance(req, ChatCompletionRequest) else None
    return CheckedConstraints(structured_output_of(req), tools)


async def checked_constraints_off_loop(
    req: CompletionRequest | ChatCompletionRequest,
) -> CheckedConstraints:
    """`checked_constraints(req)`, run in the constraint pool when `req` carries a
    constraint or tools, so neither the event loop nor the templates' pool pays for it."""
    has_tools = isinstance(req, ChatCompletionRequest) and (
        bool(req.tools) or req.tool_choice is not None
    )
    if not has_tools and not carries_constraint(req):
        return CheckedConstraints(None, None)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(constraint_pool(), checked_constraints, req)
