"""Beam search in the frontend (`dynamo.frontend.engine.beam_search`), vLLM's algorithm over any
engine client.

Claims, over a toy language model (next-token logprobs per prefix) behind an in-memory
engine client:
* the search keeps the `width` best beams by cumulative logprob and finds the sequence
  greedy decoding misses; the choices come best first, one output each, with usage;
* the end token completes a beam (dropped from its tokens unless
  `include_stop_str_in_output`; kept going with `ignore_eos`), and the final order is
  vLLM's length-penalised score;
* each step asks the engine for one token at the search's temperature with `2 x width`
  logprobs and nothing else of the request's sampling, under an id of its own;
* a step that fails fails the response;
* the preprocessor builds the search from vLLM's fields and refuses, naming it, every
  field vLLM's search would ignore; over HTTP a beam request answers `n` choices.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from frontend_support import Frontend, completion_request, openai_error_of

from dynamo.frontend.engine.beam_search import Beam, BeamSearch, BeamSearchEngineClient, beam_score
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.llm.protocols import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    TokenLogprob,
    TopLogprob,
)
from dynamo.testing.engines import InMemoryEngineClient

PROMPT = [1, 2, 3]
EOS = 9
A, B, C, D, E = 10, 11, 12, 13, 14
# Next-token logprobs after each generated prefix. Greedy takes A (-0.5) then C (-2.0):
# -2.5 in all; the best two-token sequence is B (-0.9) then E (-0.1): -1.0.
TOY = {
    (): {A: -0.5, B: -0.9, C: -5.0},
    (A,): {C: -2.0, D: -2.1, E: -6.0},
    (B,): {E: -0.1, D: -4.0, C: -5.0},
}


def toy_engine(table: dict[tuple[int, ...], dict[int, float]]) -> InMemoryEngineClient:
    async def handler(request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        prefix = tuple(request.token_ids[len(PROMPT) :])
        options = table[prefix]
        best = max(options, key=lambda t: options[t])
        top = [TopLogprob(t, lp) for t, lp in options.items()]
        yield LLMEngineOutput(
            token_ids=[best],
            log_probs=[TokenLogprob(best, options[best], top)],
            finish_reason=FinishReason.LENGTH,
        )

    return InMemoryEngineClient(handler)


def request(**sampling: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="req",
        model="m",
        token_ids=list(PROMPT),
        sampling_options=SamplingOptions(n=2, **sampling),
    )


async def search(engine: InMemoryEngineClient, **params: Any) -> list[LLMEngineOutput]:
    settings = {"width": 2, "max_tokens": 2, "temperature": 0.0, **params}
    client = BeamSearchEngineClient(engine, BeamSearch(**settings), eos_token_id=EOS)
    return [output async for output in client.generate(request())]


async def test_the_search_finds_what_greedy_misses_best_first() -> None:
    outputs = await search(toy_engine(TOY))
    assert [(o.index, o.token_ids) for o in outputs] == [(0, [B, E]), (1, [A, C])]
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs)
    usage = outputs[0].completion_usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 2)


async def test_each_step_asks_for_one_token_and_twice_the_width_of_logprobs() -> None:
    engine = toy_engine(TOY)
    await search(engine, temperature=0.7)
    steps = engine.requests
    assert len(steps) == 3  # one for the first token, then one per live beam
    assert len({step.request_id for step in steps}) == 3
    for step in steps:
        assert step.stop_conditions.max_tokens == 1
        assert step.output_options.logprobs == 4
        assert step.sampling_options == SamplingOptions(temperature=0.7)


@pytest.mark.parametrize("include_stop", [False, True])
async def test_the_end_token_completes_a_beam(include_stop: bool) -> None:
    # After A the end token is likely: that beam ends there, B goes on.
    table = {(): {A: -0.2, B: -0.3}, (A,): {EOS: -0.1, C: -3.0}, (B,): {D: -0.5, E: -0.6}}
    outputs = await search(toy_engine(table), include_stop_str_in_output=include_stop)
    ended = next(o for o in outputs if o.finish_reason is FinishReason.EOS)
    assert ended.token_ids == ([A, EOS] if include_stop else [A])
    assert {tuple(o.token_ids) for o in outputs if o is not ended} <= {(B, D), (B, E), (A, C)}


async def test_ignore_eos_keeps_the_end_token_as_a_candidate() -> None:
    table = {(): {A: -0.2, B: -0.3}, (A,): {EOS: -0.1, C: -3.0}, (B,): {D: -0.5, E: -0.6}}
    outputs = await search(toy_engine(table), ignore_eos=True)
    assert outputs[0].token_ids == [A, EOS] and outputs[0].finish_reason is FinishReason.LENGTH


def test_the_final_order_is_vllms_length_penalised_score() -> None:
    short, long = Beam([A], -1.0, finished=True), Beam([A, B, C], -1.2)
    # Over the length with the prompt (3): -1/4 = -0.25 against -1.2/6 = -0.2.
    assert beam_score(long, 3, EOS, 1.0) > beam_score(short, 3, EOS, 1.0)
    # Without length normalisation the shorter one wins.
    assert beam_score(short, 3, EOS, 0.0) > beam_score(long, 3, EOS, 0.0)
    assert beam_score(Beam([A, EOS], -1.0), 3, EOS, 1.0) == -1.0 / 4  # the end not counted


async def test_a_failed_step_fails_the_response() -> None:
    async def handler(request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(finish_reason=FinishReason.ERROR, error="engine died")

    outputs = await search(InMemoryEngineClient(handler))
    assert [(o.finish_reason, o.error) for o in outputs] == [(FinishReason.ERROR, "engine died")]


def test_the_preprocessor_builds_the_search_from_vllms_fields(preprocessor: Preprocessor) -> None:
    prepared = preprocessor.prepare_completion_sync(
        completion_request(
            use_beam_search=True, n=3, max_tokens=5, temperature=0.0, length_penalty=0.5
        ),
        "r",
    )
    assert prepared.beam_search == BeamSearch(
        width=3, max_tokens=5, temperature=0.0, length_penalty=0.5
    )
    plain = preprocessor.prepare_completion_sync(completion_request(max_tokens=5), "r")
    assert plain.beam_search is None


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"stop": ["x"]}, "stop"),
        ({"top_p": 0.5}, "top_p"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprob_token_ids": [5], "logprobs": 1}, "logprob_token_ids"),
        ({"response_format": {"type": "json_object"}}, "structured output"),
        ({"echo": True}, "echo"),
    ],
)
def test_fields_the_search_would_ignore_are_refused(
    preprocessor: Preprocessor, fields: dict[str, Any], param: str
) -> None:
    req = completion_request(use_beam_search=True, n=2, max_tokens=4, **fields)
    error = openai_error_of(lambda: preprocessor.prepare_completion_sync(req, "r"))
    assert error.status == 400 and error.param == param


def test_length_penalty_without_beam_search_is_a_400(preprocessor: Preprocessor) -> None:
    req = completion_request(length_penalty=0.5, max_tokens=4)
    error = openai_error_of(lambda: preprocessor.prepare_completion_sync(req, "r"))
    assert error.param == "length_penalty"
    neutral = completion_request(length_penalty=1.0, max_tokens=4)
    assert preprocessor.prepare_completion_sync(neutral, "r").beam_search is None


async def test_a_beam_request_answers_n_choices_over_http(frontend: Frontend) -> None:
    import aiohttp

    body = {"model": "tiny-chat", "prompt": "Say hello", "use_beam_search": True, "n": 2,
            "max_tokens": 3, "temperature": 0}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        async with session.post(frontend.url + "/v1/completions", json=body) as resp:
            reply = await resp.json()
    assert resp.status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert all(c["text"] and c["finish_reason"] in ("stop", "length") for c in reply["choices"])
    assert reply["usage"]["completion_tokens"] > 0
    steps = frontend.client.requests
    assert all(step.stop_conditions.max_tokens == 1 for step in steps[-3:])
    assert steps[-1].output_options.logprobs == 4
