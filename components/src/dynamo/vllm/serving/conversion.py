"""Translation between the wire types and vLLM's request/response objects.

Pure functions (no engine, no NATS) so the mapping is unit-testable. The engine runs with
`detokenize=False` and `RequestOutputKind.DELTA`: the worker streams token ids only and the
frontend owns detokenization and stop strings.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptLogprobs,
    PromptTokensDetails,
    RankedLogprob,
    SamplingOptions,
    SpecDecodeStats,
    StructuredOutput,
    TokenLogprob,
    TopLogprob,
)
from dynamo.vllm.speculative.opt_out import OPT_OUT_KEY

# Sampling fields copied one-to-one when the request sets them: the wire type's own, but
# Dynamo's `speculative_decoding`, which travels in `extra_args` (`speculative.opt_out`).
_SAMPLING_FIELDS = tuple(
    f for f in SamplingOptions.__struct_fields__ if f != "speculative_decoding"
)
# Those a model's generation config may give a default: not `n`, which only a request sets.
_DEFAULTABLE = frozenset(_SAMPLING_FIELDS) - {"n"}


UNAPPLIED_WHILE_SPECULATING = ("min_p", "logit_bias")
"""Sampling fields vLLM does not apply while it speculates: with a speculative config it
loads none of its built-in logits processors but min-tokens', and `SamplingParams.verify`
refuses a request that sets one ("The min_p and logit_bias sampling parameters are not
yet supported with speculative decoding"). A worker here refuses it first, naming the
field and the way out; and drops a model default for one, which would otherwise be sent
back with every request and make vLLM refuse them all."""


UNREPORTED_WHILE_SPECULATING = "logprob_token_ids"
"""An output option vLLM 0.32 gets wrong while it speculates: its rejection sampler
computes only the top `logprobs`, so the chosen ids' logprobs come back misaligned with the
accepted tokens (the sampled token missing, at -inf; seen on the n-gram worker). A worker
here refuses it rather than answer with wrong numbers."""


def unapplied_while_speculating(request: PreprocessedRequest) -> str | None:
    """The first field of `request` a speculating vLLM engine does not apply or report
    right (a neutral value, such as `min_p` 0, is no request for it), or None."""
    for name in UNAPPLIED_WHILE_SPECULATING:
        if getattr(request.sampling_options, name):
            return name
    if request.output_options.logprob_token_ids:
        return UNREPORTED_WHILE_SPECULATING
    return None


def to_sampling_params(
    request: PreprocessedRequest,
    *,
    model_defaults: dict[str, Any] | None = None,
    max_model_len: int | None = None,
    force_max_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> SamplingParams:
    """Build vLLM `SamplingParams` for a request.

    `model_defaults` are the model's generation-config defaults (vLLM's
    `model_config.get_diff_sampling_param()`), applied where the request is silent, exactly
    as `vllm serve` does: a request without `max_tokens` gets the rest of the context, or
    the model's default `max_tokens` where that is smaller. `force_max_tokens` overrides
    max_tokens (prefill legs use 1).
    """
    kwargs: dict[str, Any] = {}
    for key, value in (model_defaults or {}).items():
        if key in _DEFAULTABLE or key == "max_tokens":
            kwargs[key] = value
    opts = request.sampling_options
    for name in _SAMPLING_FIELDS:
        value = getattr(opts, name)
        if value is not None:
            kwargs[name] = value

    stop = request.stop_conditions
    max_tokens = stop.max_tokens
    if max_tokens is None and max_model_len is not None:
        rest_of_context = max(1, max_model_len - len(request.token_ids))
        default = kwargs.get("max_tokens")
        max_tokens = rest_of_context if default is None else min(default, rest_of_context)
    if force_max_tokens is not None:
        max_tokens = force_max_tokens
        # A prefill leg computes the prompt's KV once; the decode leg samples the n
        # sequences (vLLM's children share that prompt's blocks through its prefix cache).
        kwargs.pop("n", None)
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    if stop.min_tokens is not None:
        kwargs["min_tokens"] = stop.min_tokens
    if stop.stop_token_ids:
        kwargs["stop_token_ids"] = list(stop.stop_token_ids)
    kwargs["ignore_eos"] = bool(stop.ignore_eos)
    if request.output_options.logprobs is not None:
        kwargs["logprobs"] = request.output_options.logprobs
    if request.output_options.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = request.output_options.prompt_logprobs
    if request.output_options.logprob_token_ids:
        kwargs["logprob_token_ids"] = list(request.output_options.logprob_token_ids)
    if request.structured_output is not None:
        kwargs["structured_outputs"] = to_structured_outputs(request.structured_output)

    extra: dict[str, Any] = {}
    if kv_transfer_params:
        extra["kv_transfer_params"] = kv_transfer_params
    if opts.speculative_decoding is False:
        extra[OPT_OUT_KEY] = True
    return SamplingParams(
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        skip_special_tokens=False,
        extra_args=extra or None,
        **kwargs,
    )


def to_structured_outputs(constraint: StructuredOutput) -> StructuredOutputsParams:
    """The wire constraint as vLLM's `StructuredOutputsParams`. vLLM checks that exactly
    one constraint is set (`VLLMValidationError`, a client error) and compiles it with the
    engine's structured-outputs backend (xgrammar by default, on CPU) when the request is
    added, refusing what the compiler cannot take the same way."""
    return StructuredOutputsParams(
        json=constraint.json_schema,
        json_object=constraint.json_object,
        regex=constraint.regex,
        choice=list(constraint.choice) if constraint.choice is not None else None,
        grammar=constraint.grammar,
        structural_tag=constraint.structural_tag,
        disable_any_whitespace=constraint.disable_any_whitespace,
        disable_additional_properties=constraint.disable_additional_properties,
        whitespace_pattern=constraint.whitespace_pattern,
    )


def to_prompt(request: PreprocessedRequest) -> TokensPrompt:
    return TokensPrompt(prompt_token_ids=list(request.token_ids))


def map_finish_reason(reason: str | None, stop_reason: int | str | None) -> FinishReason | None:
    """vLLM's finish reasons → wire enum. vLLM says "stop" both for EOS (stop_reason None)
    and for a stop token (stop_reason = the id); the distinction matters to clients."""
    if reason is None:
        return None
    if reason == "stop":
        return FinishReason.EOS if stop_reason is None else FinishReason.STOP
    if reason == "length":
        return FinishReason.LENGTH
    if reason == "abort":
        return FinishReason.CANCELLED
    return FinishReason.ERROR


def _logprobs(output: CompletionOutput, token_ids: list[int]) -> list[TokenLogprob] | None:
    if not output.logprobs:
        return None
    result: list[TokenLogprob] = []
    for token_id, position in zip(token_ids, output.logprobs, strict=False):
        chosen = position.get(token_id)
        top = [TopLogprob(tid, float(lp.logprob)) for tid, lp in position.items()]
        top.sort(key=lambda t: -t.logprob)
        result.append(
            TokenLogprob(
                token_id=token_id,
                logprob=float(chosen.logprob) if chosen is not None else float("-inf"),
                top=top,
            )
        )
    return result


def prompt_logprobs_of(ro: RequestOutput) -> PromptLogprobs | None:
    """vLLM's prompt logprobs (per position: token id -> `Logprob` with its rank, the
    prompt's own token first) as the wire's lists; None when the output carries none."""
    positions = ro.prompt_logprobs
    if not positions:
        return None
    result: PromptLogprobs = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        result.append(
            [
                RankedLogprob(int(token_id), float(lp.logprob), int(lp.rank or 0))
                for token_id, lp in position.items()
            ]
        )
    return result


def spec_stats_from(output: CompletionOutput) -> SpecDecodeStats | None:
    """Per-request speculative statistics from vLLM's `RequestSpecDecodeMetrics`
    (present on the final output when `per_request_spec_decode_metrics` is enabled)."""
    metrics = output.spec_decode_metrics
    if metrics is None:
        return None
    histogram = list(metrics.histogram)
    steps = sum(histogram)
    accepted = sum(j * count for j, count in enumerate(histogram))
    return SpecDecodeStats(
        num_drafts=steps,
        num_draft_tokens=int(metrics.num_draft_tokens),
        num_accepted_tokens=accepted,
        acceptance_histogram=histogram,
    )


class OutputTracker:
    """Turns one request's stream of DELTA `RequestOutput`s into `LLMEngineOutput`s,
    counting completion tokens per sequence for the usage block of each sequence's final
    output.

    With `n` > 1 (vLLM's parallel sampling) a `RequestOutput` carries the new tokens of
    one or more of the n child sequences, each `CompletionOutput` naming its sequence by
    `index`; every one becomes its own wire output with that `index`. Each sequence's
    final output carries its own finish reason and usage; the request is over when vLLM
    says `finished` (every sequence done)."""

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self._completion_tokens: dict[int, int] = {}
        self._finished: set[int] = set()

    @property
    def completion_tokens(self) -> int:
        """Completion tokens of all sequences together."""
        return sum(self._completion_tokens.values())

    def convert(self, ro: RequestOutput) -> LLMEngineOutput:
        """The wire output of a one-sequence request's step."""
        result = self._convert_one(ro, ro.outputs[0])
        result.prompt_logprobs = prompt_logprobs_of(ro)
        return result

    def convert_all(self, ro: RequestOutput) -> list[LLMEngineOutput]:
        """One wire output per sequence `ro` carries (n > 1: any of the n, by `index`);
        the prompt's logprobs, which belong to the request, ride on the first."""
        results = [self._convert_one(ro, out) for out in ro.outputs]
        if results:
            results[0].prompt_logprobs = prompt_logprobs_of(ro)
        return results

    def unfinished(self, n: int) -> list[int]:
        """The sequences (of `n`) that have not sent their final output yet."""
        return [index for index in range(n) if index not in self._finished]

    def _convert_one(self, ro: RequestOutput, out: CompletionOutput) -> LLMEngineOutput:
        token_ids = list(out.token_ids)
        index = out.index
        self._completion_tokens[index] = self._completion_tokens.get(index, 0) + len(token_ids)
        result = LLMEngineOutput(
            token_ids=token_ids, index=index, log_probs=_logprobs(out, token_ids)
        )
        # A child of a parallel request finishes on its own output; the request as a
        # whole (n = 1: the one sequence) when vLLM marks it finished.
        if out.finish_reason is not None or (ro.finished and len(ro.outputs) == 1):
            self._finished.add(index)
            result.finish_reason = map_finish_reason(out.finish_reason or "abort", out.stop_reason)
            result.stop_reason = out.stop_reason
            result.completion_usage = self.usage(ro.num_cached_tokens or 0, index)
            result.spec_decode_stats = spec_stats_from(out)
            if ro.kv_transfer_params:
                result.disaggregated_params = dict(ro.kv_transfer_params)
        return result

    def usage(self, cached_tokens: int, index: int = 0) -> CompletionUsage:
        """Usage of sequence `index`: the prompt (shared by all sequences) and its own
        completion tokens; the frontend sums the completions of all sequences."""
        completion = self._completion_tokens.get(index, 0)
        return CompletionUsage(
            prompt_tokens=self.prompt_len,
            completion_tokens=completion,
            total_tokens=self.prompt_len + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )
