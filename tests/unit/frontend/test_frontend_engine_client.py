"""`RuntimeEngineClient` over a stand-in for `dynamo.runtime.Client`: every placement
through the router, re-placement that avoids the instance that failed, error mapping,
cancellation and router bookkeeping. (The real `Client` is tested against a real
nats-server in tests/integration.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dynamo.frontend.engine_client import (
    EngineFailedError,
    EngineUnavailableError,
    RuntimeEngineClient,
)
from dynamo.llm.protocols import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    PromptTokensDetails,
    StopConditions,
)
from dynamo.llm.router import RandomRouter, RoundRobinRouter
from dynamo.runtime import InstanceGoneError, NoInstancesError, RemoteError, StreamTimeoutError


class FakeStream:
    """A response stream to one instance, scripted as a list of outputs and exceptions."""

    def __init__(self, instance_id: int, items: list[Any]) -> None:
        self.instance_id = instance_id
        self._items: Iterator[Any] = iter(items)
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        item = next(self._items, StopAsyncIteration())
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


class FakeClient:
    """Answers `direct` with the next scripted stream; `routable_ids` is `ids`."""

    def __init__(self, scripts: list[list[Any]], ids: list[int] | None = None) -> None:
        self._scripts = iter(scripts)
        self.ids = [1, 2] if ids is None else ids
        self.sent: list[tuple[str, int]] = []
        self.requests: list[PreprocessedRequest] = []
        self.streams: list[FakeStream] = []

    def instance_ids(self) -> list[int]:
        return list(self.ids)

    def routable_ids(self) -> list[int]:
        return list(self.ids)

    def direct(self, request: Any, instance_id: int, **kwargs: Any) -> FakeStream:
        assert instance_id in self.ids, "the router picks among the routable instances"
        assert kwargs["response_type"] is LLMEngineOutput
        self.requests.append(request)
        self.sent.append((kwargs["request_id"], instance_id))
        stream = FakeStream(instance_id, next(self._scripts))
        self.streams.append(stream)
        return stream

    async def close(self) -> None:
        pass


class BookkeepingRouter(RandomRouter):
    def __init__(self) -> None:
        super().__init__()
        self.first: list[str] = []
        self.finished: list[str] = []

    def on_first_output(self, request_id: str, output: LLMEngineOutput) -> None:
        self.first.append(request_id)

    def on_finished(self, request_id: str) -> None:
        self.finished.append(request_id)


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(request_id="req", model="m", token_ids=[1, 2])


DONE = LLMEngineOutput(token_ids=[7], finish_reason=FinishReason.EOS)


async def _collect(client: RuntimeEngineClient) -> list[LLMEngineOutput]:
    return [out async for out in client.generate(_request())]


def _client(fake: FakeClient, **kwargs: Any) -> RuntimeEngineClient:
    return RuntimeEngineClient(fake, RoundRobinRouter(), **kwargs)


async def test_outputs_stream_through_and_the_router_is_told() -> None:
    fake = FakeClient([[LLMEngineOutput(token_ids=[5]), DONE]])
    router = BookkeepingRouter()
    outputs = await _collect(RuntimeEngineClient(fake, router))
    assert [o.token_ids for o in outputs] == [[5], [7]]
    assert fake.sent[0][0] == "req" and fake.sent[0][1] in (1, 2)  # random router picks
    assert router.first == ["req"] and router.finished == ["req"]
    assert fake.streams[0].closed


async def test_worker_gone_before_first_output_is_placed_again_elsewhere() -> None:
    fake = FakeClient([[InstanceGoneError(1)], [DONE]])
    outputs = await _collect(_client(fake))
    assert outputs == [DONE]
    assert len(fake.sent) == 2
    first, second = fake.sent[0][1], fake.sent[1][1]
    assert first != second, "the instance the request was lost on is not offered again"


async def test_every_instance_lost_before_output_is_unavailable() -> None:
    """One instance, gone before its first output: no other candidate, so 503 rather
    than sending to the same dead worker again."""
    fake = FakeClient([[InstanceGoneError(1)], [DONE]], ids=[1])
    with pytest.raises(EngineUnavailableError):
        await _collect(_client(fake))
    assert fake.sent == [("req", 1)]


async def test_worker_gone_after_output_is_a_failure() -> None:
    fake = FakeClient([[LLMEngineOutput(token_ids=[5]), InstanceGoneError(1)]])
    with pytest.raises(EngineFailedError, match="worker lost"):
        await _collect(_client(fake))
    assert len(fake.sent) == 1


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RemoteError("CUDA OOM", "RuntimeError"), EngineFailedError),
        (StreamTimeoutError("no frame"), EngineFailedError),
        (NoInstancesError("none"), EngineUnavailableError),
    ],
)
async def test_runtime_errors_are_mapped(error: Exception, expected: type) -> None:
    fake = FakeClient([[error]] * 3)
    with pytest.raises(expected):
        await _collect(_client(fake))


async def test_no_instances_is_unavailable_without_sending() -> None:
    fake = FakeClient([], ids=[])
    with pytest.raises(EngineUnavailableError):
        await _collect(_client(fake))
    assert fake.sent == []


async def test_closing_early_closes_the_runtime_stream() -> None:
    fake = FakeClient([[LLMEngineOutput(token_ids=[i]) for i in range(10)]])
    router = BookkeepingRouter()
    gen = RuntimeEngineClient(fake, router).generate(_request())
    assert (await gen.__anext__()).token_ids == [0]
    await gen.aclose()
    assert fake.streams[0].closed
    assert router.finished == ["req"]


async def test_migration_continues_on_another_worker_with_the_generated_tokens() -> None:
    final = LLMEngineOutput(
        token_ids=[13],
        finish_reason=FinishReason.LENGTH,
        completion_usage=CompletionUsage(
            prompt_tokens=5, completion_tokens=1, total_tokens=6,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=5),
        ),
    )  # fmt: skip
    fake = FakeClient(
        [
            [
                LLMEngineOutput(token_ids=[10, 11]),
                LLMEngineOutput(token_ids=[12]),
                InstanceGoneError(1),
            ],
            [final],
        ]
    )
    router = BookkeepingRouter()
    client = RuntimeEngineClient(fake, router, migration_limit=1)
    request = PreprocessedRequest(
        request_id="req",
        model="m",
        token_ids=[1, 2],
        stop_conditions=StopConditions(max_tokens=4, min_tokens=2),
    )
    outputs = [out async for out in client.generate(request)]
    assert [t for o in outputs for t in o.token_ids] == [10, 11, 12, 13]
    resumed = fake.requests[1]
    assert resumed.token_ids == [1, 2, 10, 11, 12]
    assert resumed.stop_conditions.max_tokens == 1 and resumed.stop_conditions.min_tokens == 0
    usage = outputs[-1].completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2, 4, 6)
    assert usage.prompt_tokens_details.cached_tokens == 2
    assert client.migrations == 1
    assert router.finished == ["req", "req"]
    assert fake.sent[0][1] != fake.sent[1][1], "migration goes to another instance"


async def test_migration_limit_is_respected() -> None:
    fake = FakeClient(
        [
            [LLMEngineOutput(token_ids=[10]), InstanceGoneError(1)],
            [LLMEngineOutput(token_ids=[11]), InstanceGoneError(2)],
        ]
    )
    client = _client(fake, migration_limit=1)
    with pytest.raises(EngineFailedError, match="worker lost"):
        await _collect(client)
    assert len(fake.sent) == 2 and client.migrations == 1
