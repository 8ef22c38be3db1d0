"""`RuntimeEngineClient` when workers refuse: a worker at its bound of requests in flight
(`InstanceOverloadedError`), a worker refusing the request's parameters (a `RemoteError`
of kind `INVALID_REQUEST`), and a router that judges every worker busy
(`AllWorkersBusyError`); and the frontend's busy-threshold flags.

Claims: an overloaded worker is left out and the request placed on another, with the
booking of each placement released; when every worker tried refuses (or the only one
does) the request is `EngineOverloadedError` (HTTP 503 with Retry-After); a parameter
refusal is `EngineRejectedError` (HTTP 400) and never sent anywhere else; an all-busy
router sends nothing and is `EngineOverloadedError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from frontend_support import FakeClient

from dynamo.frontend.__main__ import build_parser, config_from_args
from dynamo.frontend.engine.client import RuntimeEngineClient
from dynamo.frontend.engine.errors import (
    EngineFailedError,
    EngineOverloadedError,
    EngineRejectedError,
)
from dynamo.llm.protocols import FinishReason, LLMEngineOutput, PreprocessedRequest
from dynamo.llm.router import AllWorkersBusyError, RoundRobinRouter
from dynamo.runtime import ErrorKind, InstanceOverloadedError, RemoteError

DONE = LLMEngineOutput(token_ids=[7], finish_reason=FinishReason.LENGTH)


class RecordingRouter(RoundRobinRouter):
    """Round-robin that records what it was offered and what it released."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: list[list[int]] = []
        self.finished = 0

    async def select(self, request: PreprocessedRequest, instance_ids: Sequence[int]) -> int:
        self.offered.append(list(instance_ids))
        return await super().select(request, instance_ids)

    def on_finished(self, request_id: str) -> None:
        self.finished += 1


class BusyRouter(RecordingRouter):
    async def select(self, request: PreprocessedRequest, instance_ids: Sequence[int]) -> int:
        self.offered.append(list(instance_ids))
        raise AllWorkersBusyError(f"all {len(instance_ids)} workers are over their thresholds")


def overloaded(instance_id: int) -> InstanceOverloadedError:
    return InstanceOverloadedError(instance_id, "the worker is serving its limit of 1 requests")


async def run(client: FakeClient, router: RecordingRouter) -> list[LLMEngineOutput]:
    engine = RuntimeEngineClient(client, router)  # type: ignore[arg-type]
    request = PreprocessedRequest(request_id="r", model="m", token_ids=[1, 2, 3])
    return [out async for out in engine.generate(request)]


async def test_an_overloaded_worker_is_skipped_and_the_request_runs_elsewhere() -> None:
    client = FakeClient.per_instance({1: [overloaded(1)], 2: [DONE]})
    router = RecordingRouter()
    assert await run(client, router) == [DONE]
    assert client.sent_to == [1, 2]
    assert router.offered == [[1, 2], [2]]  # the refusing worker is not offered again
    assert router.finished == 2  # each placement's booking released


@pytest.mark.parametrize("instances", [1, 2, 3])
async def test_when_every_worker_refuses_the_request_is_overloaded(instances: int) -> None:
    client = FakeClient.per_instance({i: [overloaded(i)] for i in range(1, instances + 1)})
    router = RecordingRouter()
    with pytest.raises(EngineOverloadedError):
        await run(client, router)
    assert sorted(client.sent_to) == list(range(1, instances + 1))  # each tried once
    assert router.finished == instances


async def test_a_parameter_refusal_is_the_clients_error_and_not_retried() -> None:
    refusal = RemoteError("top_p must be in (0, 1], got 0.0.", ErrorKind.INVALID_REQUEST.value)
    client = FakeClient.per_instance({1: [refusal], 2: [DONE]})
    router = RecordingRouter()
    with pytest.raises(EngineRejectedError) as info:
        await run(client, router)
    assert str(info.value) == "top_p must be in (0, 1], got 0.0."
    assert len(client.sent_to) == 1
    assert router.finished == 1


async def test_an_engine_failure_is_not_a_parameter_refusal() -> None:
    client = FakeClient.per_instance({1: [RemoteError("CUDA OOM", "RuntimeError")]})
    with pytest.raises(EngineFailedError, match="CUDA OOM"):
        await run(client, RecordingRouter())


async def test_a_router_finding_every_worker_busy_sends_nothing() -> None:
    client = FakeClient.per_instance({1: [DONE], 2: [DONE]})
    router = BusyRouter()
    with pytest.raises(EngineOverloadedError, match="over their thresholds"):
        await run(client, router)
    assert client.sent_to == []
    assert router.offered == [[1, 2]]


def test_busy_flags_and_their_variables_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_BUSY_KV_USAGE", raising=False)
    monkeypatch.delenv("DYN_BUSY_WAITING_REQUESTS", raising=False)
    config = config_from_args(build_parser().parse_args([]))
    assert (config.router.busy_kv_usage, config.router.busy_waiting_requests) == (None, None)  # off
    argv = ["--busy-kv-usage", "0.9", "--busy-waiting-requests", "4"]
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.router.busy_kv_usage, config.router.busy_waiting_requests) == (0.9, 4)
    monkeypatch.setenv("DYN_BUSY_KV_USAGE", "0.75")
    monkeypatch.setenv("DYN_BUSY_WAITING_REQUESTS", "16")
    config = config_from_args(build_parser().parse_args([]))
    assert (config.router.busy_kv_usage, config.router.busy_waiting_requests) == (0.75, 16)
    for bad in (
        ["--busy-kv-usage", "1.5"],
        ["--busy-kv-usage", "0"],
        ["--busy-waiting-requests", "0"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
