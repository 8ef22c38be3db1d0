"""`EngineStream`: batching of queued outputs and cancellation of the engine stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.frontend.engine.errors import EngineFailedError
from dynamo.frontend.engine.stream import EngineStream
from dynamo.llm.protocols import FinishReason, LLMEngineOutput, PreprocessedRequest
from dynamo.testing.engines import InMemoryEngineClient


def _request(rid: str = "r") -> PreprocessedRequest:
    return PreprocessedRequest(request_id=rid, model="m", token_ids=[1])


def _outputs(count: int, delay: float = 0.0, fail: bool = False):
    async def handler(request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        for i in range(count):
            if delay:
                await asyncio.sleep(delay)
            last = i == count - 1
            yield LLMEngineOutput(
                token_ids=[i], finish_reason=FinishReason.EOS if last and not fail else None
            )
        if fail:
            raise EngineFailedError("lost")

    return handler


async def _drain(stream: EngineStream) -> list[list[int]]:
    batches = []
    while batch := await stream.next_batch():
        batches.append([t for out in batch for t in out.token_ids])
    return batches


async def test_outputs_already_queued_come_as_one_batch() -> None:
    engine = InMemoryEngineClient(_outputs(6))
    stream = EngineStream(engine.generate(_request()))
    assert await _drain(stream) == [[0, 1, 2, 3, 4, 5]]
    await stream.aclose()
    assert engine.completed == ["r"] and engine.cancelled == []


async def test_paced_outputs_come_one_by_one() -> None:
    stream = EngineStream(InMemoryEngineClient(_outputs(4, delay=0.01)).generate(_request()))
    assert await _drain(stream) == [[0], [1], [2], [3]]


async def test_a_failure_is_raised_after_the_outputs_before_it() -> None:
    stream = EngineStream(InMemoryEngineClient(_outputs(3, fail=True)).generate(_request()))
    batch = await stream.next_batch()
    assert [out.token_ids for out in batch] == [[0], [1], [2]]
    with pytest.raises(EngineFailedError):
        await stream.next_batch()
    assert await stream.next_batch() == []


async def test_closing_early_cancels_the_engine_request() -> None:
    engine = InMemoryEngineClient(_outputs(1000, delay=0.005))
    stream = EngineStream(engine.generate(_request("abc")))
    assert await stream.next_batch()
    await stream.aclose()
    assert engine.cancelled == ["abc"]
    assert await stream.next_batch() == []
    await stream.aclose()  # idempotent
