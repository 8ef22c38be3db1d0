"""Wire types ↔ vLLM objects (`dynamo.vllm.serving.conversion`), checked on vLLM's own classes.

Claims:
* `to_sampling_params` maps every `SamplingOptions` field and the stop conditions the
  engine enforces, applies the model's generation-config defaults only where the request
  is silent, fills a silent `max_tokens` with the rest of the context, lets
  `force_max_tokens` win, puts `kv_transfer_params` into `extra_args`, and always asks
  for DELTA outputs of token ids only (the frontend detokenizes and matches stop strings);
* `to_prompt` hands vLLM the request's token ids;
* `OutputTracker.convert` passes token deltas through, puts the finish reason (EOS vs a
  stop token vs abort), the usage with cached prompt tokens, the transfer parameters and
  the speculative statistics on the last output only, and converts logprobs;
* `spec_stats_from` reads vLLM's per-request speculative metrics.

No engine, no model: `SamplingParams`, `RequestOutput`, `CompletionOutput`, `Logprob`,
`FlatLogprobs` and `RequestSpecDecodeMetrics` are constructed directly.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import vllm_outputs
from vllm.logprobs import FlatLogprobs, Logprob, SampleLogprobs
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics
from vllm_outputs import completion

from dynamo.llm.protocols import (
    FinishReason,
    OutputOptions,
    PreprocessedRequest,
    RankedLogprob,
    SamplingOptions,
    SpecDecodeStats,
    StopConditions,
    TokenLogprob,
    TopLogprob,
)
from dynamo.vllm.serving.conversion import (
    OutputTracker,
    spec_stats_from,
    to_prompt,
    to_sampling_params,
)
from dynamo.vllm.speculative.opt_out import OPT_OUT_KEY, opted_out

PROMPT = [101, 102, 103, 104]

# A value for every SamplingOptions field, none of them vLLM's default (so a field that
# is not mapped shows up) and none that vLLM rewrites (temperature 0 resets top_p/top_k).
SAMPLING_VALUES: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "seed": 1234,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "n": 2,
    "logit_bias": {5: 1.5, 7: -100.0},
    "allowed_token_ids": [5, 6, 7],
    "bad_words": ["forbidden"],
    "thinking_token_budget": 16,
}


def make_request(
    *,
    sampling: SamplingOptions | None = None,
    stop: StopConditions | None = None,
    output: OutputOptions | None = None,
    token_ids: list[int] | None = None,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="req-1",
        model="tiny",
        token_ids=list(PROMPT if token_ids is None else token_ids),
        sampling_options=sampling or SamplingOptions(),
        stop_conditions=stop or StopConditions(),
        output_options=output or OutputOptions(),
    )


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The `SamplingOptions` fields that are vLLM's, as vLLM holds them."""
    return {name: getattr(params, name) for name in SAMPLING_VALUES}


# --------------------------------------------------------------------- to_sampling_params


def test_the_test_values_cover_every_sampling_option() -> None:
    # Dynamo's `speculative_decoding` is no `SamplingParams` field (see below).
    assert set(SAMPLING_VALUES) | {"speculative_decoding"} == set(SamplingOptions.__struct_fields__)


def test_every_sampling_option_reaches_vllm() -> None:
    params = to_sampling_params(make_request(sampling=SamplingOptions(**SAMPLING_VALUES)))
    sent = sampling_fields(params)
    numbers = {k: v for k, v in SAMPLING_VALUES.items() if isinstance(v, int | float)}
    assert {k: sent[k] for k in numbers} == pytest.approx(numbers)
    assert {k: sent[k] for k in SAMPLING_VALUES if k not in numbers} == {
        k: v for k, v in SAMPLING_VALUES.items() if k not in numbers
    }


def test_a_silent_request_gets_vllms_neutral_defaults() -> None:
    params = to_sampling_params(make_request())
    assert sampling_fields(params) == sampling_fields(SamplingParams())
    assert params.max_tokens == SamplingParams().max_tokens


def test_stop_conditions_the_engine_enforces_reach_vllm() -> None:
    stop = StopConditions(
        max_tokens=12, min_tokens=3, stop=["###"], stop_token_ids=[7, 8], ignore_eos=True
    )
    assert set(msgspec.structs.asdict(stop)) == set(StopConditions.__struct_fields__)
    params = to_sampling_params(make_request(stop=stop))
    assert (params.max_tokens, params.min_tokens) == (12, 3)
    assert params.stop_token_ids == [7, 8]
    assert params.ignore_eos is True
    assert params.stop == [], "stop strings are matched by the frontend, on text"


def test_without_stop_conditions_eos_is_honoured_and_nothing_is_added() -> None:
    params = to_sampling_params(make_request())
    assert params.ignore_eos is False
    assert params.stop_token_ids == [] and params.min_tokens == 0


def test_the_number_of_logprobs_reaches_vllm() -> None:
    assert to_sampling_params(make_request(output=OutputOptions(logprobs=3))).logprobs == 3
    assert to_sampling_params(make_request()).logprobs is None
    asked = make_request(output=OutputOptions(prompt_logprobs=2))
    assert to_sampling_params(asked).prompt_logprobs == 2
    chosen = make_request(output=OutputOptions(logprob_token_ids=[5, 9]))
    assert to_sampling_params(chosen).logprob_token_ids == [5, 9]
    assert to_sampling_params(make_request()).prompt_logprobs is None


def test_model_defaults_fill_only_what_the_request_leaves_out() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 77}
    request = make_request(sampling=SamplingOptions(temperature=0.2, top_k=5))
    params = to_sampling_params(request, model_defaults=defaults)
    assert (params.temperature, params.top_k) == pytest.approx((0.2, 5)), "request wins"
    assert params.top_p == pytest.approx(0.95), "silent request: the model's default"
    assert params.max_tokens == 77
    assert params.min_p == SamplingParams().min_p, "no default, no request: vLLM's"


def test_a_requested_max_tokens_beats_the_models_default() -> None:
    params = to_sampling_params(
        make_request(stop=StopConditions(max_tokens=5)), model_defaults={"max_tokens": 77}
    )
    assert params.max_tokens == 5


def test_model_defaults_that_are_not_sampling_options_are_ignored() -> None:
    params = to_sampling_params(make_request(), model_defaults={"n": 4, "temperature": 0.5})
    assert params.n == 1
    assert params.temperature == pytest.approx(0.5)


def test_a_silent_max_tokens_is_the_rest_of_the_context() -> None:
    params = to_sampling_params(make_request(), max_model_len=100)
    assert params.max_tokens == 100 - len(PROMPT)


def test_a_prompt_that_fills_the_context_still_asks_for_one_token() -> None:
    full = list(range(100))
    assert to_sampling_params(make_request(token_ids=full), max_model_len=100).max_tokens == 1


def test_a_requested_max_tokens_is_kept_when_the_context_is_known() -> None:
    # The frontend rejects requests that do not fit the context; the worker keeps the number.
    params = to_sampling_params(make_request(stop=StopConditions(max_tokens=9)), max_model_len=100)
    assert params.max_tokens == 9


def test_a_models_default_max_tokens_caps_the_rest_of_the_context() -> None:
    """As `vllm serve`: the smaller of the model's default and what the context leaves."""
    params = to_sampling_params(make_request(), model_defaults={"max_tokens": 8}, max_model_len=100)
    assert params.max_tokens == 8
    short = to_sampling_params(
        make_request(), model_defaults={"max_tokens": 500}, max_model_len=100
    )
    assert short.max_tokens == 100 - len(make_request().token_ids)


def test_force_max_tokens_overrides_the_request_and_the_context() -> None:
    request = make_request(stop=StopConditions(max_tokens=50))
    params = to_sampling_params(
        request, model_defaults={"max_tokens": 77}, max_model_len=100, force_max_tokens=1
    )
    assert params.max_tokens == 1


def test_kv_transfer_params_travel_in_extra_args() -> None:
    transfer = {"do_remote_decode": True, "remote_block_ids": [1, 2]}
    params = to_sampling_params(make_request(), kv_transfer_params=transfer)
    assert params.extra_args == {"kv_transfer_params": transfer}


def test_a_request_that_turns_speculation_off_says_so_in_extra_args() -> None:
    off = to_sampling_params(make_request(sampling=SamplingOptions(speculative_decoding=False)))
    assert off.extra_args == {OPT_OUT_KEY: True}
    assert opted_out(off)
    for unset in (None, True):
        on = to_sampling_params(make_request(sampling=SamplingOptions(speculative_decoding=unset)))
        assert on.extra_args is None and not opted_out(on)
    assert not opted_out(None)  # a pooling request has no sampling parameters


@pytest.mark.parametrize("transfer", [None, {}])
def test_no_kv_transfer_params_means_no_extra_args(transfer: dict[str, Any] | None) -> None:
    assert to_sampling_params(make_request(), kv_transfer_params=transfer).extra_args is None


def test_vllm_streams_token_id_deltas_only() -> None:
    params = to_sampling_params(make_request(stop=StopConditions(stop=["</s>"])))
    assert params.output_kind is RequestOutputKind.DELTA
    assert params.detokenize is False
    assert params.skip_special_tokens is False


# ------------------------------------------------------------------------------ to_prompt


def test_the_prompt_is_the_requests_token_ids() -> None:
    request = make_request()
    prompt = to_prompt(request)
    assert prompt["prompt_token_ids"] == PROMPT
    request.token_ids.append(999)
    assert prompt["prompt_token_ids"] == PROMPT, "vLLM gets its own list"


# -------------------------------------------------------------------------- OutputTracker


def request_output(
    out: CompletionOutput,
    *,
    finished: bool | None = None,
    num_cached_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> RequestOutput:
    """`out` for this module's prompt."""
    return vllm_outputs.request_output(
        out,
        prompt_token_ids=PROMPT,
        finished=finished,
        num_cached_tokens=num_cached_tokens,
        kv_transfer_params=kv_transfer_params,
    )


def test_token_deltas_pass_through_and_only_the_last_output_finishes() -> None:
    tracker = OutputTracker(len(PROMPT))
    first = tracker.convert(request_output(completion([5, 6])))
    second = tracker.convert(request_output(completion([7])))
    last = tracker.convert(request_output(completion([8, 9], finish_reason="length")))
    assert [first.token_ids, second.token_ids, last.token_ids] == [[5, 6], [7], [8, 9]]
    for partial in (first, second):
        assert partial.finish_reason is None
        assert partial.completion_usage is None
        assert partial.disaggregated_params is None and partial.spec_decode_stats is None
    assert last.finish_reason is FinishReason.LENGTH
    assert last.completion_usage is not None
    usage = last.completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(PROMPT),
        5,
        len(PROMPT) + 5,
    )


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [
        ("stop", None, FinishReason.EOS),
        ("stop", 42, FinishReason.STOP),
        ("stop", "###", FinishReason.STOP),
        ("length", None, FinishReason.LENGTH),
        ("abort", None, FinishReason.CANCELLED),
        ("error", None, FinishReason.ERROR),
    ],
)
def test_finish_reasons_map_to_the_wire(
    finish_reason: str, stop_reason: int | str | None, expected: FinishReason
) -> None:
    out = OutputTracker(len(PROMPT)).convert(
        request_output(completion([1], finish_reason=finish_reason, stop_reason=stop_reason))
    )
    assert out.finish_reason is expected
    assert out.stop_reason == stop_reason


def test_a_finished_request_without_a_reason_counts_as_aborted() -> None:
    out = OutputTracker(len(PROMPT)).convert(request_output(completion([]), finished=True))
    assert out.finish_reason is FinishReason.CANCELLED
    assert out.completion_usage is not None


@pytest.mark.parametrize(("cached", "expected"), [(16, 16), (0, 0), (None, 0)])
def test_cached_prompt_tokens_are_reported_on_the_last_output(
    cached: int | None, expected: int
) -> None:
    tracker = OutputTracker(len(PROMPT))
    partial = tracker.convert(request_output(completion([1]), num_cached_tokens=cached))
    last = tracker.convert(
        request_output(completion([2], finish_reason="stop"), num_cached_tokens=cached)
    )
    assert partial.completion_usage is None
    assert last.completion_usage is not None
    assert last.completion_usage.prompt_tokens_details is not None
    assert last.completion_usage.prompt_tokens_details.cached_tokens == expected


def test_usage_without_outputs_counts_the_prompt_only() -> None:
    usage = OutputTracker(7).usage(cached_tokens=3)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 0, 7)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3


def test_transfer_params_are_handed_back_on_the_last_output() -> None:
    transfer = {"remote_block_ids": [3, 4], "remote_engine_id": "e"}
    out = OutputTracker(len(PROMPT)).convert(
        request_output(completion([1], finish_reason="length"), kv_transfer_params=transfer)
    )
    assert out.disaggregated_params == transfer
    assert out.disaggregated_params is not transfer, "a copy: vLLM keeps its own"


def positions() -> list[dict[int, Logprob]]:
    """Two generated tokens (5, then 6) with their top alternatives, not in rank order."""
    return [
        {7: Logprob(-2.0, rank=2), 5: Logprob(-0.5, rank=1)},
        {6: Logprob(-1.5, rank=2), 8: Logprob(-0.25, rank=1), 9: Logprob(-3.0, rank=3)},
    ]


EXPECTED_LOGPROBS = [
    TokenLogprob(5, -0.5, [TopLogprob(5, -0.5), TopLogprob(7, -2.0)]),
    TokenLogprob(6, -1.5, [TopLogprob(8, -0.25), TopLogprob(6, -1.5), TopLogprob(9, -3.0)]),
]


def flat(dicts: list[dict[int, Logprob]]) -> FlatLogprobs:
    result = FlatLogprobs()
    result.extend(dicts)
    return result


@pytest.mark.parametrize("container", [list, flat], ids=["dicts", "flat"])
def test_logprobs_carry_the_chosen_token_and_the_top_ones_best_first(container: Any) -> None:
    out = OutputTracker(len(PROMPT)).convert(
        request_output(completion([5, 6], logprobs=container(positions())))
    )
    assert out.log_probs == EXPECTED_LOGPROBS


def test_a_chosen_token_missing_from_the_logprobs_gets_minus_infinity() -> None:
    logprobs = [{7: Logprob(-2.0, rank=1)}]
    out = OutputTracker(len(PROMPT)).convert(request_output(completion([5], logprobs=logprobs)))
    assert out.log_probs is not None
    assert out.log_probs[0].token_id == 5 and math.isinf(out.log_probs[0].logprob)
    assert out.log_probs[0].logprob < 0


def test_prompt_logprobs_keep_vllms_order_and_ranks() -> None:
    """The prompt's own token first (here ranked 2), then the alternatives; the first
    position has none; they ride on the output that carried them, once."""
    prompt_positions = [
        {PROMPT[1]: Logprob(-1.5, rank=2), 9: Logprob(-0.5, rank=1)},
        {PROMPT[2]: Logprob(-0.25, rank=1)},
    ]
    tracker = OutputTracker(len(PROMPT))
    ro = vllm_outputs.request_output(
        completion([5]),
        prompt_token_ids=PROMPT,
        prompt_logprobs=[None, *prompt_positions],
    )
    (first,) = tracker.convert_all(ro)
    assert first.prompt_logprobs == [
        None,
        [RankedLogprob(PROMPT[1], -1.5, 2), RankedLogprob(9, -0.5, 1)],
        [RankedLogprob(PROMPT[2], -0.25, 1)],
    ]
    assert tracker.convert_all(request_output(completion([6])))[0].prompt_logprobs is None


@pytest.mark.parametrize("logprobs", [None, []])
def test_no_logprobs_requested_means_none_sent(logprobs: SampleLogprobs | None) -> None:
    out = OutputTracker(len(PROMPT)).convert(request_output(completion([5], logprobs=logprobs)))
    assert out.log_probs is None


def speculative_metrics() -> RequestSpecDecodeMetrics:
    """Three verify steps of 3 drafts each, accepting 3, 1 and 0 of them."""
    metrics = RequestSpecDecodeMetrics.new(num_spec_tokens=3)
    for accepted in (3, 1, 0):
        metrics.observe(num_draft_tokens=3, num_accepted=accepted)
    return metrics


EXPECTED_SPEC_STATS = SpecDecodeStats(
    num_drafts=3, num_draft_tokens=9, num_accepted_tokens=4, acceptance_histogram=[1, 1, 0, 1]
)


def test_speculative_statistics_ride_on_the_last_output() -> None:
    out = OutputTracker(len(PROMPT)).convert(
        request_output(
            completion([1, 2], finish_reason="length", spec_decode_metrics=speculative_metrics())
        )
    )
    assert out.spec_decode_stats == EXPECTED_SPEC_STATS


# ------------------------------------------------------------------------ spec_stats_from


def test_spec_stats_are_read_from_vllms_per_request_metrics() -> None:
    metrics = speculative_metrics()
    stats = spec_stats_from(completion([], spec_decode_metrics=metrics))
    assert stats == EXPECTED_SPEC_STATS
    vllm_view = metrics.to_dict()
    assert stats.mean_acceptance_length == pytest.approx(vllm_view["mean_acceptance_length"])
    assert stats.num_accepted_tokens == vllm_view["num_accepted_draft_tokens"]


def test_no_speculative_metrics_means_no_stats() -> None:
    assert spec_stats_from(completion([1])) is None
