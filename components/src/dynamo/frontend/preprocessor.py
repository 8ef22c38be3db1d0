"""Turns an OpenAI request into a `PreprocessedRequest` for a worker, plus the plan the
frontend follows to turn the worker's token stream back into a response.

The frontend owns tokenization, the chat template and validation, so workers only ever
see token ids, and a bad request is rejected here with a 400 naming the field before any
worker is touched. Everything the worker does not need (stop strings, echo, logprobs
formatting, usage in the stream) stays in the `OutputPlan`.

Requests are untrusted: what they may ask of the frontend is bounded (`limits`) before
the work is done, `chat_template_kwargs` may only fill the template's variables
(`template_kwargs`), and chat templates are always rendered in a worker thread, so a slow
template never stalls the event loop. Output constraints and tool schemas are checked in
a pool of their own before that (`structured_output.constraint_pool`): a large schema
costs its own request time, not the event loop's nor the templates' pool.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from dynamo.frontend.beam_search import BeamSearch
from dynamo.frontend.detokenizer import DecodeFn, TokenTexts, make_decode_fn
from dynamo.frontend.errors import OpenAIError, bad_request
from dynamo.frontend.limits import (
    PromptBound,
    check_buffered_logprobs,
    check_buffered_prompt_logprobs,
    check_message_count,
    check_stop,
    check_token_prompt,
    context_exceeded,
)
from dynamo.frontend.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from dynamo.frontend.structured_output import (
    carries_constraint,
    constraint_pool,
    structured_output_of,
)
from dynamo.frontend.template_kwargs import REASONING_EFFORTS, TemplateKwargsPolicy
from dynamo.frontend.tool_calls import (
    ToolRequest,
    template_reads_tools,
    tool_request,
    with_tool_constraint,
)
from dynamo.frontend.truncation import PromptTruncation
from dynamo.llm.protocols import (
    ModelCard,
    OutputOptions,
    PreprocessedRequest,
    SamplingDefaults,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
)

T = TypeVar("T")

# Completion prompts longer than this (in characters) are tokenized in a worker thread:
# below it the thread hop costs more than the work, above it a single request could stall
# every other stream on the event loop for milliseconds. (Chat requests always go to a
# thread: the template's running time does not follow the input's size.)
LARGE_INPUT_CHARS = 8192
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


@dataclass(frozen=True)
class OutputPlan:
    """What the frontend itself must do with the engine's output for one request."""

    stream: bool
    include_usage: bool
    stop_strings: tuple[str, ...]
    # Token ids whose text is hidden when they end the sequence (EOS, stop_token_ids).
    hidden_stop_ids: frozenset[int]
    skip_special_tokens: bool
    logprobs: int | None  # None: not requested; N: N top alternatives per token
    # Completions: the prompt; chat: the last message when it is the assistant's (vLLM's
    # `echo`). Written before the generated text of every choice.
    echo_text: str | None = None
    include_stop_str: bool = False  # the matched stop string (or stop token) is kept
    # `return_token_ids`: the response carries the prompt's and each choice's token ids.
    return_token_ids: bool = False
    prompt_token_ids: list[int] | None = None  # set only with `return_token_ids`
    tokens_as_ids: bool = False  # logprob tokens named `token_id:N`
    # Alternatives per prompt position the response reports (vLLM's `prompt_logprobs`;
    # completions' `echo` with `logprobs` asks for them too); None: not asked for.
    prompt_logprobs: int | None = None
    # vLLM's `logprob_token_ids`: the alternatives reported at each generated position are
    # these (after the sampled token), in this order.
    logprob_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Prepared:
    """A validated request: what goes to the worker and what stays in the frontend."""

    request: PreprocessedRequest
    plan: OutputPlan
    # vLLM's `use_beam_search`: the frontend runs the search (`beam_search`), the worker
    # sees one-token requests.
    beam_search: BeamSearch | None = None


def load_tokenizer(tokenizer_dir: str | Path) -> Any:
    """Load a Hugging Face tokenizer from a local directory (never from a hub).

    Slow (imports transformers, parses tokenizer.json): call it from a thread.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


class Preprocessor:
    """Validation, chat templating and tokenization for one served model.

    Built once per model from its card (context length, EOS ids) and its own tokenizer;
    shared by all requests for that model. All methods are safe to call from worker
    threads: templating renders text and encoding goes through the Rust tokenizer, which
    holds no per-call state.
    """

    def __init__(self, card: ModelCard, tokenizer: Any, chat_template: str | None = None) -> None:
        """`chat_template`: Jinja source replacing the model's own (`--chat-template`)."""
        self.card = card
        if chat_template is not None:
            tokenizer = copy.copy(tokenizer)  # the caller's tokenizer keeps its own template
            tokenizer.chat_template = chat_template
        self.tokenizer = tokenizer
        self.template_reads_tools = template_reads_tools(getattr(tokenizer, "chat_template", None))
        self.context_length = card.context_length
        self.eos_token_ids = _eos_ids(card, tokenizer)
        self.vocab_size = len(tokenizer)
        _disable_truncation(tokenizer)
        self._encode = _make_encode_fn(tokenizer)
        self._decode_skip = make_decode_fn(tokenizer, skip_special_tokens=True)
        self._decode_keep = make_decode_fn(tokenizer, skip_special_tokens=False)
        self.token_texts = TokenTexts(tokenizer)
        self.template_kwargs = TemplateKwargsPolicy.for_tokenizer(tokenizer)
        self.prompt_bound = PromptBound.for_tokenizer(tokenizer)

    @classmethod
    def from_dir(
        cls, card: ModelCard, tokenizer_dir: str | Path, chat_template: str | None = None
    ) -> Preprocessor:
        return cls(card, load_tokenizer(tokenizer_dir), chat_template)

    @property
    def beam_eos_token_id(self) -> int:
        """The end token beam search completes a beam at: the tokenizer's, as vLLM's
        search uses it (else the model's first)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            return eos
        return self.eos_token_ids[0] if self.eos_token_ids else -1  # -1: no end token

    def decode_fn(self, skip_special_tokens: bool) -> DecodeFn:
        return self._decode_skip if skip_special_tokens else self._decode_keep

    # ------------------------------------------------------------------ public entry points

    async def prepare_completion(self, req: CompletionRequest, request_id: str) -> Prepared:
        """Validate and tokenize a /v1/completions request (off-loop when large)."""
        constraints = await checked_constraints_off_loop(req)
        size = _prompt_size(req.prompt)
        return await _maybe_in_thread(
            size, self.prepare_completion_sync, req, request_id, constraints
        )

    async def prepare_chat(self, req: ChatCompletionRequest, request_id: str) -> Prepared:
        """Validate, template and tokenize a /v1/chat/completions request, in a worker
        thread whatever its size (see `LARGE_INPUT_CHARS`)."""
        constraints = await checked_constraints_off_loop(req)
        return await asyncio.to_thread(self.prepare_chat_sync, req, request_id, constraints)

    def prepare_completion_sync(
        self,
        req: CompletionRequest,
        request_id: str,
        constraints: CheckedConstraints | None = None,
    ) -> Prepared:
        """`constraints`: `checked_constraints(req)` when the caller already has them."""
        constraints = constraints or checked_constraints(req)
        _check_common(req)
        truncation = PromptTruncation.of(req, self.context_length)
        add_special = req.add_special_tokens is not False  # vLLM's default here: true
        token_ids, prompt_text = self._completion_prompt(req.prompt, add_special, truncation)
        echo_text = None
        if req.echo:
            kept_text = prompt_text if truncation is None else None
            echo_text = kept_text if kept_text is not None else self._decode_keep(token_ids)
        return self._build(
            req,
            request_id,
            token_ids,
            max_tokens=req.max_tokens,
            max_tokens_param="max_tokens",
            prompt_param="prompt",
            logprobs=req.logprobs,
            echo_text=echo_text,
            structured_output=constraints.output,
        )

    def prepare_chat_sync(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        constraints: CheckedConstraints | None = None,
    ) -> Prepared:
        """`constraints`: `checked_constraints(req)` when the caller already has them."""
        constraints = constraints or checked_constraints(req)
        _check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        tools = constraints.tools
        truncation = PromptTruncation.of(req, self.context_length)
        text = self._bounded_text(self.render_chat(req, tools), truncation, "messages")
        # vLLM's default for chat: false (the template writes the special tokens).
        token_ids = self._truncated(self._encode(text, bool(req.add_special_tokens)), truncation)
        max_tokens, param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        return self._build(
            req,
            request_id,
            token_ids,
            max_tokens=max_tokens,
            max_tokens_param=param,
            prompt_param="messages",
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            echo_text=_chat_echo(req) if req.echo else None,
            structured_output=with_tool_constraint(
                constraints.output, tools.constraint if tools is not None else None
            ),
        )

    def render_chat(self, req: ChatCompletionRequest, tools: ToolRequest | None = None) -> str:
        """The prompt text from the model's own chat template (or `--chat-template`),
        with the request's tools (`tools`: `tool_request(req)`, computed when not given)."""
        tools = tools if tools is not None else tool_request(req)
        if not req.messages:
            raise bad_request("`messages` must contain at least one message", "messages")
        check_message_count(req.messages)
        template_args = self.template_kwargs.check(req.chat_template_kwargs)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request(
                f"Model `{self.card.name}` has no chat template; use /v1/completions",
                "messages",
            )
        continue_final = bool(
            _first_set(req.continue_final_message, template_args.continue_final_message)
        )
        add_generation = _first_set(req.add_generation_prompt, template_args.add_generation_prompt)
        if continue_final and add_generation:
            raise bad_request(
                "`continue_final_message` and `add_generation_prompt` cannot both be true",
                "continue_final_message",
            )
        if add_generation is None:
            add_generation = not continue_final
        messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
        variables = {
            **template_args.variables,
            **_top_level_template_variables(req, template_args.variables),
            **self._tool_arguments(tools),
        }
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation,
                continue_final_message=continue_final,
                **variables,
            )
        except OpenAIError:
            raise
        except Exception as exc:  # jinja raises for messages the template refuses
            raise bad_request(
                f"The chat template rejected the messages: {exc}", "messages"
            ) from exc
        return rendered if isinstance(rendered, str) else str(rendered)

    # ------------------------------------------------------------------ internals

    def _tool_arguments(self, tools: ToolRequest | None) -> dict[str, Any]:
        """`tools=` for the template; 400 when the template would drop them (vLLM serve
        renders such a request without its tools, and the model never hears of them)."""
        if tools is None:
            return {}
        if not self.template_reads_tools:
            raise bad_request(
                f"The chat template of model `{self.card.name}` has no tools section, so "
                "the model would never see `tools`; start the frontend with "
                "`--chat-template FILE` naming a template that renders them "
                "(examples/chat_templates/smollm2_tools.jinja for SmolLM2)",
                "tools",
            )
        return {"tools": tools.template_tools}

    def _completion_prompt(
        self, prompt: Any, add_special: bool, truncation: PromptTruncation | None
    ) -> tuple[list[int], str | None]:
        """Token ids of a completions prompt (truncated as asked), plus its text when it
        was given as text."""
        if isinstance(prompt, str):
            return self._checked_text_prompt(prompt, add_special, truncation), prompt
        if not prompt:
            raise bad_request("`prompt` must not be empty", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return self._checked_ids(prompt, truncation), None
        if len(prompt) > 1:
            raise bad_request(
                "Only one prompt per request is supported (a string or a list of token ids)",
                "prompt",
            )
        only = prompt[0]
        if isinstance(only, str):
            return self._checked_text_prompt(only, add_special, truncation), only
        return self._checked_ids(only, truncation), None

    def _checked_text_prompt(
        self, text: str, add_special: bool, truncation: PromptTruncation | None
    ) -> list[int]:
        ids = self._encode(self._bounded_text(text, truncation, "prompt"), add_special)
        if not ids:
            raise bad_request("`prompt` must not be empty", "prompt")
        return self._truncated(ids, truncation)

    def _bounded_text(self, text: str, truncation: PromptTruncation | None, param: str) -> str:
        """`text` if it can fit the context; else a 400, or, when the request truncates,
        the side it keeps cut to what the context could hold (as vLLM trims before
        tokenizing), so an over-long prompt is never tokenized whole."""
        limit = self.prompt_bound.max_chars(self.context_length)
        if truncation is None or limit is None:
            self.prompt_bound.check_text(len(text), self.context_length, param)
            return text
        return truncation.trim_text(text, limit)

    def _truncated(self, ids: list[int], truncation: PromptTruncation | None) -> list[int]:
        if truncation is None:
            return ids
        kept = truncation.apply(ids)
        if not kept:
            raise bad_request(
                "`truncate_prompt_tokens` keeps no token of the prompt", "truncate_prompt_tokens"
            )
        return kept

    def _checked_ids(self, ids: Sequence[Any], truncation: PromptTruncation | None) -> list[int]:
        if not ids:
            raise bad_request("`prompt` must not be empty", "prompt")
        if truncation is not None:
            ids = self._truncated(list(ids), truncation)
        check_token_prompt(len(ids), self.context_length, "prompt")  # before the vocab scan
        if not all(isinstance(t, int) for t in ids):
            raise bad_request("`prompt` token list must contain only integers", "prompt")
        bad = next((t for t in ids if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Token id {bad} in `prompt` is outside the vocabulary (size {self.vocab_size})",
                "prompt",
            )
        return list(ids)

    def _build(
        self,
        req: SamplingFields,
        request_id: str,
        token_ids: list[int],
        *,
        max_tokens: int | None,
        max_tokens_param: str,
        prompt_param: str,
        logprobs: int | None,
        echo_text: str | None,
        structured_output: StructuredOutput | None,
    ) -> Prepared:
        max_tokens = self._checked_max_tokens(
            len(token_ids), max_tokens, max_tokens_param, prompt_param
        )
        if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
            raise bad_request("`min_tokens` must not exceed the maximum tokens", "min_tokens")
        check_buffered_logprobs(
            choices=req.n or 1,
            max_tokens=max_tokens,
            alternatives=logprobs,
            stream=bool(req.stream),
        )
        prompt_logprobs = self._checked_prompt_logprobs(req, len(token_ids), logprobs)
        chosen_ids = self._checked_logprob_token_ids(req, logprobs)
        stops = _stop_strings(req.stop)
        stop_token_ids = list(req.stop_token_ids or [])
        self._check_in_vocabulary(stop_token_ids, "stop_token_ids")
        self._check_in_vocabulary(req.allowed_token_ids or (), "allowed_token_ids")
        logit_bias = logit_bias_by_token(req.logit_bias)
        self._check_in_vocabulary(logit_bias or (), "logit_bias")
        request = PreprocessedRequest(
            request_id=request_id,
            model=self.card.name,
            token_ids=token_ids,
            sampling_options=_sampling_options(req, self.card.sampling_defaults, logit_bias),
            stop_conditions=StopConditions(
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=list(stops) or None,
                stop_token_ids=stop_token_ids or None,
                ignore_eos=bool(req.ignore_eos),
            ),
            output_options=OutputOptions(
                # vLLM: the chosen ids replace the top alternatives
                logprobs=None if chosen_ids else logprobs,
                prompt_logprobs=prompt_logprobs,
                logprob_token_ids=list(chosen_ids) or None,
            ),
            eos_token_ids=list(self.eos_token_ids),
            structured_output=structured_output,
        )
        include_stop = bool(req.include_stop_str_in_output)
        hidden: set[int] = set() if include_stop else set(stop_token_ids)
        if not req.ignore_eos and not include_stop:
            hidden.update(self.eos_token_ids)
        plan = OutputPlan(
            stream=bool(req.stream),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            stop_strings=stops,
            hidden_stop_ids=frozenset(hidden),
            skip_special_tokens=req.skip_special_tokens is not False,
            # With chosen ids, every entry vLLM sends is reported: the sampled token, them.
            logprobs=len(chosen_ids) + 1 if chosen_ids else logprobs,
            echo_text=echo_text,
            include_stop_str=include_stop,
            return_token_ids=bool(req.return_token_ids),
            prompt_token_ids=token_ids if req.return_token_ids else None,
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
            prompt_logprobs=prompt_logprobs,
            logprob_token_ids=chosen_ids or None,
        )
        beam = self._checked_beam_search(req, max_tokens, logprobs, structured_output)
        return Prepared(request=request, plan=plan, beam_search=beam)

    def _checked_beam_search(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        structured_output: StructuredOutput | None,
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
        defaults = self.card.sampling_defaults
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

    def _checked_logprob_token_ids(
        self, req: SamplingFields, logprobs: int | None
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
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"token_id(s) {bad[:8]} in logprob_token_ids contain out-of-vocab token ids. "
                f"Vocabulary size: {self.vocab_size}",
                "logprob_token_ids",
            )
        return ids

    def _checked_prompt_logprobs(
        self, req: SamplingFields, prompt_len: int, logprobs: int | None
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
            raise bad_request(
                "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs"
            )
        elif req.stream and asked != 0:
            raise bad_request(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        check_buffered_prompt_logprobs(prompt_len, self.vocab_size if asked == -1 else asked)
        return asked

    def _check_in_vocabulary(self, token_ids: Iterable[int], field: str) -> None:
        """400 naming `field` for the first token id outside the tokenizer's vocabulary
        (vLLM refuses the same ids, but only once the request reached a worker)."""
        bad = next((t for t in token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} in `{field}` is outside the vocabulary", field)

    def _checked_max_tokens(
        self, prompt_len: int, max_tokens: int | None, param: str, prompt_param: str
    ) -> int | None:
        """Enforce prompt + max_tokens <= context length; default to the model's default
        (generation_config's `max_new_tokens`) capped by the rest of the context, as
        `vllm serve` does."""
        ctx = self.context_length
        defaults = self.card.sampling_defaults
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


# ---------------------------------------------------------------------- helpers


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


def _check_common(req: SamplingFields) -> None:
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


def _sampling_options(
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


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    return tuple(dict.fromkeys(s for s in items if s))


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: content flattened to one string."""
    out: dict[str, Any] = {
        "role": message.role,
        "content": _flatten_content(index, message.content),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _flatten_content(index: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"Unsupported content part `{part.type}` in `messages[{index}].content[{j}]`: "
                "only text parts are supported",
                "messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _chat_echo(req: ChatCompletionRequest) -> str | None:
    """vLLM's chat `echo`: the last message's text when the assistant wrote it (the
    response then continues it), else nothing."""
    last = req.messages[-1] if req.messages else None
    if last is None or last.role != "assistant":
        return None
    return _flatten_content(len(req.messages) - 1, last.content) or None


def _top_level_template_variables(
    req: ChatCompletionRequest, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """`documents` and `reasoning_effort` for the chat template, as vLLM passes them
    (they win over the same keys in `chat_template_kwargs`); a reasoning effort also sets
    `enable_thinking` (false for `none`) unless the kwargs set it."""
    variables: dict[str, Any] = {}
    if req.documents is not None:
        variables["documents"] = req.documents
    effort = req.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"`reasoning_effort` must be one of {', '.join(REASONING_EFFORTS)}",
                "reasoning_effort",
            )
        variables["reasoning_effort"] = effort
        if "enable_thinking" not in kwargs:
            variables["enable_thinking"] = effort != "none"
    return variables


def _first_set(*values: bool | None) -> bool | None:
    """The first value that is not None (a top-level field wins over a template kwarg)."""
    return next((v for v in values if v is not None), None)


def _prompt_size(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) if isinstance(p, str) else 1 for p in prompt)


def _eos_ids(card: ModelCard, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from the card (the worker knows the generation config); the tokenizer's
    own EOS only when the card has none."""
    if card.eos_token_ids:
        return tuple(card.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return (eos,) if isinstance(eos, int) else ()


def _disable_truncation(tokenizer: Any) -> None:
    """A tokenizer.json may carry truncation/padding settings for training; a prompt must
    never be cut silently (the context check reports it instead). Done once, before the
    tokenizer is shared between threads."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    if getattr(backend, "truncation", None) is not None:
        backend.no_truncation()
    if getattr(backend, "padding", None) is not None:
        backend.no_padding()


def _make_encode_fn(tokenizer: Any) -> Callable[[str, bool], list[int]]:
    """`(text, add_special_tokens) -> ids` through the Rust tokenizer when available: it is
    faster and, unlike the Python wrapper, mutates no truncation state, so concurrent
    calls from threads are safe."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        # The batch-of-one "fast" entry point skips computing character offsets, which
        # nothing here reads: a third less time for a 256-token prompt (0.45 against
        # 0.68 ms measured on the embedded model's tokenizer), the same ids.
        encode_batch = backend.encode_batch_fast

        def fastest(text: str, add_special_tokens: bool) -> list[int]:
            return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

        return fastest
    if backend is not None and hasattr(backend, "encode"):

        def fast(text: str, add_special_tokens: bool) -> list[int]:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids

        return fast

    def slow(text: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    return slow


async def _maybe_in_thread(size: int, fn: Callable[..., T], *args: Any) -> T:
    if size > LARGE_INPUT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
