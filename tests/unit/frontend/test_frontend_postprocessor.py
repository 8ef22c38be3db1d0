"""Stop strings, finish reasons, hidden stop tokens, usage and logprobs, from real token
ids through the `Postprocessor`."""

from __future__ import annotations

from typing import Any

import pytest
from frontend_support import EOS, output_plan

from dynamo.frontend.postprocess.detokenizer import TokenTexts, make_decode_fn
from dynamo.frontend.postprocess.postprocessor import Postprocessor, openai_finish_reason
from dynamo.frontend.postprocess.stop_strings import StopStringMatcher
from dynamo.frontend.preprocess.preprocessor import OutputPlan
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
)


def _plan(**overrides: Any) -> OutputPlan:
    return output_plan(**{"stream": True, "hidden_stop_ids": frozenset({EOS}), **overrides})


def _post(tokenizer: Any, plan: OutputPlan, prompt: list[int] | None = None) -> Postprocessor:
    decode = make_decode_fn(tokenizer, skip_special_tokens=plan.skip_special_tokens)
    return Postprocessor(plan, prompt or [1, 2, 3], decode, TokenTexts(tokenizer))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def _run(
    post: Postprocessor, ids: list[int], step: int, final: LLMEngineOutput
) -> tuple[str, list]:
    """Feed `ids` in steps, then `final`; return (all text, deltas)."""
    deltas = []
    for i in range(0, len(ids), step):
        deltas.append(post.process([LLMEngineOutput(token_ids=ids[i : i + step])]))
        if post.finished:
            return "".join(d.text for d in deltas), deltas
    deltas.append(post.process([final]))
    return "".join(d.text for d in deltas), deltas


# ---------------------------------------------------------------------- stop strings


def test_stop_matcher_holds_a_partial_stop_across_chunks() -> None:
    matcher = StopStringMatcher(["Hello"])
    assert matcher.feed("Say Hel") == ("Say ", None)
    assert matcher.feed("lo world") == ("", "Hello")
    assert matcher.flush() == ""


def test_stop_matcher_releases_held_text_once_it_cannot_match() -> None:
    matcher = StopStringMatcher(["STOP", "END"])
    assert matcher.feed("abc ST") == ("abc ", None)
    assert matcher.feed("ART E") == ("START ", None)
    assert matcher.flush() == "E"


def test_stop_matcher_cuts_at_the_earliest_of_several_stops() -> None:
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == ("hel", "lo w")


@pytest.mark.parametrize("step", [1, 2, 4])
def test_stop_string_split_across_tokens_is_not_leaked(tokenizer: Any, step: int) -> None:
    text = "The answer is forty-two. Goodbye now, see you."
    stop = "Goodbye"
    ids = _ids(tokenizer, text)
    assert all(stop not in tokenizer.decode([t]) for t in ids), "stop must span tokens"
    post = _post(tokenizer, _plan(stop_strings=(stop,)))
    final = LLMEngineOutput(token_ids=[EOS], finish_reason=FinishReason.EOS)
    out, deltas = _run(post, ids, step, final)
    assert out == "The answer is forty-two. "
    assert all(stop[:3] not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    assert post.stop_reason == stop
    assert post.finished


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("step", [1, 3, 100])
def test_a_stop_string_ends_the_response_at_the_token_that_completed_it(
    tokenizer: Any, step: int, include: bool
) -> None:
    """However many tokens an output carries (speculation, or engine steps that queued up
    behind a busy frontend), the tokens after the one that completed the stop string are
    neither counted nor returned, nor their logprobs: the same answer as one token at a
    time, which is what vLLM's own server gives."""
    text = "The capital of Japan is Tokyo. It is a big city."
    ids = _ids(tokenizer, text)
    upto = next(i for i in range(len(ids)) if "." in tokenizer.decode(ids[: i + 1]))
    logprobs = [TokenLogprob(token_id=t, logprob=-0.5) for t in ids]
    post = _post(
        tokenizer,
        _plan(stop_strings=(".",), include_stop_str=include, logprobs=0, return_token_ids=True),
    )
    deltas = [
        post.process(
            [LLMEngineOutput(token_ids=ids[i : i + step], log_probs=logprobs[i : i + step])]
        )
        for i in range(0, len(ids), step)
        if not post.finished
    ]
    assert "".join(d.text for d in deltas) == (
        "The capital of Japan is Tokyo." if include else "The capital of Japan is Tokyo"
    )
    assert deltas[-1].finish_reason == "stop"
    assert post.usage().completion_tokens == upto + 1
    assert [t for d in deltas for t in d.generated_ids] == ids[: upto + 1]
    assert sum(len(d.logprobs or []) for d in deltas) == upto + 1


def test_a_multi_token_output_that_ends_the_stream_keeps_its_end(tokenizer: Any) -> None:
    """Split token by token, the last piece still carries the finish reason and usage."""
    ids = _ids(tokenizer, "No stop here")
    post = _post(tokenizer, _plan(stop_strings=("Goodbye",)))
    usage = CompletionUsage(prompt_tokens=3, completion_tokens=len(ids) + 1, total_tokens=0)
    delta = post.process(
        [
            LLMEngineOutput(
                token_ids=[*ids, EOS], finish_reason=FinishReason.EOS, completion_usage=usage
            )
        ]
    )
    assert delta.text == "No stop here"
    assert delta.finish_reason == "stop"
    assert post.usage().completion_tokens == len(ids) + 1


def test_text_held_for_a_possible_stop_is_released_at_the_end(tokenizer: Any) -> None:
    ids = _ids(tokenizer, "ends with Good")
    post = _post(tokenizer, _plan(stop_strings=("Goodbye",)))
    final = LLMEngineOutput(token_ids=[EOS], finish_reason=FinishReason.EOS)
    out, deltas = _run(post, ids, 1, final)
    assert out == "ends with Good"
    assert deltas[-1].finish_reason == "stop"


# ---------------------------------------------------------------------- finish + usage


@pytest.mark.parametrize(
    ("wire", "openai"),
    [
        (FinishReason.EOS, "stop"),
        (FinishReason.STOP, "stop"),
        (FinishReason.LENGTH, "length"),
        (FinishReason.CANCELLED, "abort"),
        (FinishReason.ERROR, None),
    ],
)
def test_finish_reason_mapping(wire: FinishReason, openai: str | None) -> None:
    assert openai_finish_reason(wire) == openai


def test_eos_token_is_hidden_and_counted(tokenizer: Any) -> None:
    plan = _plan(skip_special_tokens=False)  # even when special tokens are shown
    post = _post(tokenizer, plan)
    ids = _ids(tokenizer, "Hi there")
    delta = post.process(
        [
            LLMEngineOutput(token_ids=ids),
            LLMEngineOutput(token_ids=[EOS], finish_reason=FinishReason.EOS),
        ]
    )
    assert delta.text == "Hi there"
    assert delta.finish_reason == "stop"
    assert delta.token_count == len(ids) + 1
    assert post.usage().completion_tokens == len(ids) + 1


def test_stop_token_id_that_is_a_normal_token_is_hidden(tokenizer: Any) -> None:
    ids = _ids(tokenizer, "one two three")
    post = _post(tokenizer, _plan(hidden_stop_ids=frozenset({EOS, ids[-1]})))
    delta = post.process(
        [LLMEngineOutput(token_ids=ids, finish_reason=FinishReason.STOP, stop_reason=ids[-1])]
    )
    assert delta.text == "one two"
    assert post.stop_reason == ids[-1]


def test_usage_prefers_engine_counts_and_reports_cached_tokens(tokenizer: Any) -> None:
    post = _post(tokenizer, _plan(), prompt=list(range(10, 20)))
    final = LLMEngineOutput(
        token_ids=_ids(tokenizer, "x"),
        finish_reason=FinishReason.LENGTH,
        completion_usage=CompletionUsage(
            prompt_tokens=10,
            completion_tokens=7,
            total_tokens=17,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=4),
        ),
    )
    delta = post.process([final])
    usage = post.usage()
    assert delta.finish_reason == "length"
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 7, 17)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 4


def test_engine_error_ends_the_response_with_an_error(tokenizer: Any) -> None:
    post = _post(tokenizer, _plan())
    delta = post.process(
        [
            LLMEngineOutput(token_ids=_ids(tokenizer, "partial")),
            LLMEngineOutput(finish_reason=FinishReason.ERROR, error="engine dead"),
            LLMEngineOutput(token_ids=_ids(tokenizer, "ignored")),
        ]
    )
    assert delta.error == "engine dead"
    assert delta.text == "partial"
    assert post.finished


def test_outputs_after_the_finish_are_ignored(tokenizer: Any) -> None:
    post = _post(tokenizer, _plan())
    delta = post.process(
        [
            LLMEngineOutput(token_ids=_ids(tokenizer, "done"), finish_reason=FinishReason.LENGTH),
            LLMEngineOutput(token_ids=_ids(tokenizer, " more")),
        ]
    )
    assert delta.text == "done"
    assert post.process([LLMEngineOutput(token_ids=[5])]).text == ""


def test_stream_ending_without_finish_reason_is_reported_as_abort(tokenizer: Any) -> None:
    post = _post(tokenizer, _plan())
    assert post.process([LLMEngineOutput(token_ids=_ids(tokenizer, "cut"))]).text == "cut"
    end = post.end_of_stream()
    assert end.finish_reason == "abort"
    assert post.finished


def test_logprobs_are_mapped_to_token_texts_and_trimmed_to_top_n(tokenizer: Any) -> None:
    post = _post(tokenizer, _plan(logprobs=1))
    ids = _ids(tokenizer, " hello world")
    entries = [
        TokenLogprob(token_id=t, logprob=-0.5, top=[TopLogprob(7, -2.0), TopLogprob(t, -0.5)])
        for t in ids
    ]
    token_texts = [tokenizer.decode([t]) for t in ids]
    assert "".join(token_texts) == " hello world"
    delta = post.process([LLMEngineOutput(token_ids=ids, log_probs=entries)])
    assert delta.logprobs is not None
    assert [lp.sampled.token for lp in delta.logprobs] == token_texts
    assert all(lp.sampled.logprob == -0.5 for lp in delta.logprobs)
    assert [[a.token for a in lp.top] for lp in delta.logprobs] == [[t] for t in token_texts]
