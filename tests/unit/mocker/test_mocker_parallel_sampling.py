"""The mocker's `n` > 1: n independent sequences on one stream, as vLLM's parallel
sampling streams them (each output names its sequence by `index`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
from mocker_support import EOS, collect, config, prompt, request

from dynamo.llm.protocols import FinishReason, LLMEngineOutput, PreprocessedRequest
from dynamo.mocker import MockEngine
from dynamo.mocker.request import InvalidRequest


def with_n(req: PreprocessedRequest, n: int) -> PreprocessedRequest:
    options = msgspec.structs.replace(req.sampling_options, n=n)
    return msgspec.structs.replace(req, sampling_options=options)


def by_index(outputs: list[LLMEngineOutput]) -> dict[int, list[LLMEngineOutput]]:
    grouped: dict[int, list[LLMEngineOutput]] = {}
    for output in outputs:
        grouped.setdefault(output.index, []).append(output)
    return grouped


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    """A started mock engine with `config()`, stopped after the test."""
    engine = await MockEngine(config()).start()
    try:
        yield engine
    finally:
        await engine.stop()


async def test_n3_streams_three_independent_sequences_each_finishing(engine: MockEngine) -> None:
    outputs = await collect(engine, with_n(request("r", prompt(8), 6, seed=3), 3))
    choices = by_index(outputs)
    assert sorted(choices) == [0, 1, 2]
    tokens = {i: [t for o in outs for t in o.token_ids] for i, outs in choices.items()}
    assert len({tuple(t) for t in tokens.values()}) == 3  # independent samples
    for outs in choices.values():
        final = outs[-1]
        assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
        assert final.finish_reason is FinishReason.LENGTH
        assert final.completion_usage is not None
        assert final.completion_usage.completion_tokens == 6  # its own tokens only
    # n = 1 is the request's sequence 0: same tokens as choice 0 of n = 3.
    single = await collect(engine, request("s", prompt(8), 6, seed=3))
    assert [t for o in single for t in o.token_ids] == tokens[0]
    assert engine.pool.active_blocks == 0


async def test_closing_the_stream_aborts_every_sequence(engine: MockEngine) -> None:
    stream = engine.generate(with_n(request("r", prompt(8), 60, ignore_eos=True), 3))
    first = await anext(stream)
    assert first.index in (0, 1, 2)
    assert engine.num_running + engine.num_waiting == 3  # one request, three sequences
    await stream.aclose()
    assert engine.num_running == engine.num_waiting == 0
    assert engine.pool.active_blocks == 0


async def test_a_rejected_sequence_rejects_the_whole_request(engine: MockEngine) -> None:
    bad = with_n(request("r", [EOS + 5000], 4), 2)  # out of vocabulary
    with pytest.raises(InvalidRequest):
        await collect(engine, bad)
    assert engine.num_waiting == 0 and engine.num_running == 0
