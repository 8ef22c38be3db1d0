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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dynamo.frontend.engine.beam_search import BeamSearch
from dynamo.frontend.openai.errors import OpenAIError, bad_request
from dynamo.frontend.openai.limits import (
    PromptBound,
    check_buffered_logprobs,
    check_message_count,
    check_token_prompt,
)
from dynamo.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from dynamo.frontend.postprocess.detokenizer import DecodeFn, TokenTexts, make_decode_fn
from dynamo.frontend.preprocess.chat_messages import (
    chat_echo,
    first_set,
    message_dict,
    top_level_template_variables,
)
from dynamo.frontend.preprocess.request_checks import (
    CheckedConstraints,
    check_in_vocabulary,
    check_sampling_fields,
    checked_beam_search,
    checked_constraints,
    checked_constraints_off_loop,
    checked_logprob_token_ids,
    checked_max_tokens,
    checked_prompt_logprobs,
    logit_bias_by_token,
    sampling_options,
    stop_strings,
)
from dynamo.frontend.preprocess.template_kwargs import TemplateKwargsPolicy
from dynamo.frontend.preprocess.tokenizer_setup import (
    disable_truncation,
    eos_ids,
    load_tokenizer,
    make_encode_fn,
)
from dynamo.frontend.preprocess.tools import (
    ToolRequest,
    template_reads_tools,
    tool_request,
    with_tool_constraint,
)
from dynamo.frontend.preprocess.truncation import PromptTruncation
from dynamo.llm.protocols import (
    ModelCard,
    OutputOptions,
    PreprocessedRequest,
    StopConditions,
    StructuredOutput,
)

T = TypeVar("T")

# Completion prompts longer than this (in characters) are tokenized in a worker thread:
# below it the thread hop costs more than the work, above it a single request could stall
# every other stream on the event loop for milliseconds. (Chat requests always go to a
# thread: the template's running time does not follow the input's size.)
LARGE_INPUT_CHARS = 8192


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
        self.eos_token_ids = eos_ids(card, tokenizer)
        self.vocab_size = len(tokenizer)
        disable_truncation(tokenizer)
        self._encode = make_encode_fn(tokenizer)
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
        check_sampling_fields(req)
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
        check_sampling_fields(req)
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
            echo_text=chat_echo(req) if req.echo else None,
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
            first_set(req.continue_final_message, template_args.continue_final_message)
        )
        add_generation = first_set(req.add_generation_prompt, template_args.add_generation_prompt)
        if continue_final and add_generation:
            raise bad_request(
                "`continue_final_message` and `add_generation_prompt` cannot both be true",
                "continue_final_message",
            )
        if add_generation is None:
            add_generation = not continue_final
        messages = [message_dict(i, m) for i, m in enumerate(req.messages)]
        variables = {
            **template_args.variables,
            **top_level_template_variables(req, template_args.variables),
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
        max_tokens = checked_max_tokens(
            len(token_ids),
            max_tokens,
            max_tokens_param,
            prompt_param,
            context_length=self.context_length,
            defaults=self.card.sampling_defaults,
        )
        if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
            raise bad_request("`min_tokens` must not exceed the maximum tokens", "min_tokens")
        check_buffered_logprobs(
            choices=req.n or 1,
            max_tokens=max_tokens,
            alternatives=logprobs,
            stream=bool(req.stream),
        )
        prompt_logprobs = checked_prompt_logprobs(req, len(token_ids), logprobs, self.vocab_size)
        chosen_ids = checked_logprob_token_ids(req, logprobs, self.vocab_size)
        stops = stop_strings(req.stop)
        stop_token_ids = list(req.stop_token_ids or [])
        check_in_vocabulary(stop_token_ids, "stop_token_ids", self.vocab_size)
        check_in_vocabulary(req.allowed_token_ids or (), "allowed_token_ids", self.vocab_size)
        logit_bias = logit_bias_by_token(req.logit_bias)
        check_in_vocabulary(logit_bias or (), "logit_bias", self.vocab_size)
        request = PreprocessedRequest(
            request_id=request_id,
            model=self.card.name,
            token_ids=token_ids,
            sampling_options=sampling_options(req, self.card.sampling_defaults, logit_bias),
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
            priority=req.priority or 0,
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
        beam = checked_beam_search(
            req, max_tokens, logprobs, structured_output, self.card.sampling_defaults
        )
        return Prepared(request=request, plan=plan, beam_search=beam)


# ---------------------------------------------------------------------- helpers


def _prompt_size(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) if isinstance(p, str) else 1 for p in prompt)


async def _maybe_in_thread(size: int, fn: Callable[..., T], *args: Any) -> T:
    if size > LARGE_INPUT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
