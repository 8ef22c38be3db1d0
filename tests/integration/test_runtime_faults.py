"""Worker-side faults of the runtime against a real nats-server.

Claims:
* an endpoint serving `max_inflight` requests refuses the next one at once, without
  running it, with an error the client raises as `InstanceOverloadedError`; once a request
  ends the endpoint accepts again;
* a response frame NATS refuses to carry (larger than the server's max payload) cancels
  the handler (its `finally` runs, i.e. the engine would abort the request) and the
  client gets an error instead of waiting forever; one warning is logged;
* a worker whose NATS connection is down with its outbound buffer full cancels the
  handler instead of letting it run (and buffer) for a client that hears nothing;
* a handler refusing a request with `InvalidRequestError` reaches the client as a
  `RemoteError` of kind `INVALID_REQUEST` with the handler's message; a
  `WorkerOverloadedError` before any output reaches it as `InstanceOverloadedError`, after
  outputs as an ordinary remote error (the client must not resend it);
* a request lost between the client and the handler fails within the accept timeout
  (the worker confirms every request at once), while a handler merely slow to produce
  its first item is not failed by it.

Servers and clients are two runtimes (two NATS connections) in the test's own loop; the
outage test has a nats-server of its own, which it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
import pytest

from dynamo.nats_server import NatsServer
from dynamo.runtime import (
    Client,
    Context,
    DistributedRuntime,
    ErrorKind,
    InstanceOverloadedError,
    InvalidRequestError,
    NoResponderError,
    RemoteError,
    RequestNotAcceptedError,
    RequestTooLargeError,
    ServedEndpoint,
    WorkerOverloadedError,
    naming,
    response_stream,
    wire,
)
from dynamo.runtime.server import PUBLISH_FLUSH_TIMEOUT_S, EndpointServer
from dynamo.testing.runtimes import connected_runtime
from dynamo.testing.waiting import wait_until_async

LEASE_TTL = 5.0
STEP_TIMEOUT_S = 10.0
"""Bound on every wait of these tests: generous for a busy host, and what a hang
(the failure these tests look for) runs into."""


class Probe:
    """What a test handler saw: started, ended (its `finally` ran)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.closed = asyncio.Event()


Handler = Callable[[Any, Context], AsyncIterator[Any]]


async def serve(
    runtime: DistributedRuntime, namespace: str, handler: Handler, **kwargs: Any
) -> ServedEndpoint:
    endpoint = runtime.namespace(namespace).component("work").endpoint("generate")
    return await endpoint.serve(handler, **kwargs)


async def client_of(runtime: DistributedRuntime, namespace: str) -> Client:
    endpoint = runtime.namespace(namespace).component("work").endpoint("generate")
    client = await endpoint.client()
    await client.wait_for_instances(timeout=STEP_TIMEOUT_S)
    return client


@pytest.fixture
def namespace() -> str:
    return "faults" + uuid.uuid4().hex[:8]


def fault_runtime(
    nats_url: str, name: str
) -> contextlib.AbstractAsyncContextManager[DistributedRuntime]:
    return connected_runtime(nats_url, lease_ttl=LEASE_TTL, name=name, drain_timeout=0.5)


@pytest.fixture
async def worker_rt(nats_url: str) -> AsyncIterator[DistributedRuntime]:
    async with fault_runtime(nats_url, "fault-worker") as rt:
        yield rt


@pytest.fixture
async def client_rt(nats_url: str) -> AsyncIterator[DistributedRuntime]:
    async with fault_runtime(nats_url, "fault-client") as rt:
        yield rt


async def first_item(stream: Any) -> Any:
    return await asyncio.wait_for(stream.__anext__(), STEP_TIMEOUT_S)


async def drain(stream: Any) -> list[Any]:
    async def collect() -> list[Any]:
        return [item async for item in stream]

    return await asyncio.wait_for(collect(), STEP_TIMEOUT_S)


# --------------------------------------------------------------------------- the bound


async def test_a_full_endpoint_refuses_at_once_and_accepts_again_when_one_ends(
    worker_rt: DistributedRuntime, client_rt: DistributedRuntime, namespace: str
) -> None:
    probes: dict[str, Probe] = {}

    async def slow(request: dict[str, Any], ctx: Context) -> AsyncIterator[dict[str, Any]]:
        probe = probes.setdefault(request["name"], Probe())
        probe.started.set()
        try:
            yield {"name": request["name"]}
            await probe.release.wait()
        finally:
            probe.closed.set()

    served = await serve(worker_rt, namespace, slow, max_inflight=1)
    assert served.server is not None
    client = await client_of(client_rt, namespace)
    instance = worker_rt.instance_id

    first = client.direct({"name": "first"}, instance)
    assert (await first_item(first)) == {"name": "first"}

    refused = client.direct({"name": "second"}, instance)
    with pytest.raises(InstanceOverloadedError) as info:
        await first_item(refused)
    assert info.value.instance_id == instance
    assert "second" not in probes  # refused without running the handler
    assert served.server.requests_refused == 1
    assert served.server.in_flight == 1

    probes["first"].release.set()
    assert await drain(first) == []
    await wait_until_async(
        lambda: served.server is not None and served.server.in_flight == 0,
        timeout=STEP_TIMEOUT_S,
        what="the first request to end on the worker",
    )
    third = client.direct({"name": "third"}, instance)
    assert (await first_item(third)) == {"name": "third"}
    probes["third"].release.set()
    assert await drain(third) == []
    assert served.server.requests_refused == 1


# ------------------------------------------------------------------- failed publishes


async def test_a_frame_over_the_max_payload_cancels_the_handler_and_fails_the_stream(
    worker_rt: DistributedRuntime,
    client_rt: DistributedRuntime,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = Probe()
    huge = worker_rt.nc.max_payload + 1024

    async def oversized(request: Any, ctx: Context) -> AsyncIterator[Any]:
        try:
            yield "small"
            yield b"x" * huge  # NATS refuses to carry this frame
            probe.started.set()  # the handler would go on generating...
            await asyncio.Event().wait()  # ...for a client that never hears of it
        finally:
            probe.closed.set()

    await serve(worker_rt, namespace, oversized)
    client = await client_of(client_rt, namespace)
    stream = client.direct(None, worker_rt.instance_id)
    caplog.set_level(logging.WARNING, logger="dynamo.runtime.server")

    assert (await first_item(stream)) == "small"
    with pytest.raises(RemoteError) as info:
        await first_item(stream)
    assert info.value.kind is ErrorKind.INTERNAL
    assert info.value.remote_type == "MaxPayloadError"
    assert "could not send its response" in info.value.message
    await asyncio.wait_for(probe.closed.wait(), STEP_TIMEOUT_S)
    warnings = [r for r in caplog.records if r.name == "dynamo.runtime.server"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "not sent" in warnings[0].getMessage()


async def test_requests_over_the_max_payload_arrive_whole_in_parts(
    worker_rt: DistributedRuntime, client_rt: DistributedRuntime, namespace: str
) -> None:
    """A request over nats-server's message limit (1 MiB here) travels in parts and the
    handler gets it whole; several such requests at once are joined side by side."""

    async def handler(request: Any, ctx: Context) -> AsyncIterator[Any]:
        yield [len(request), hashlib.sha256(request).hexdigest()]

    served = await serve(worker_rt, namespace, handler)
    client = await client_of(client_rt, namespace)
    limit = client_rt.nc.max_payload
    payloads = [os.urandom(n) for n in (3 * limit + 17, limit + 1, 2 * limit)]
    answers = await asyncio.gather(
        *(first_item(client.direct(p, worker_rt.instance_id)) for p in payloads)
    )
    assert answers == [[len(p), hashlib.sha256(p).hexdigest()] for p in payloads]
    assert served.server is not None
    assert served.server.joiner.requests_joined == 3
    assert served.server.joiner.bytes_held == 0


async def test_a_request_over_the_carried_bound_is_refused_before_anything_is_sent(
    worker_rt: DistributedRuntime,
    client_rt: DistributedRuntime,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What no instance would take is a typed error at the client (HTTP 400 at the
    frontend), nothing is sent and the handler never runs."""
    calls: list[Any] = []

    async def handler(request: Any, ctx: Context) -> AsyncIterator[Any]:
        calls.append(request)
        yield "ok"

    bound = 2 * client_rt.nc.max_payload
    monkeypatch.setattr(response_stream, "MAX_CARRIED_REQUEST_BYTES", bound)
    await serve(worker_rt, namespace, handler)
    client = await client_of(client_rt, namespace)
    with pytest.raises(RequestTooLargeError) as info:
        await first_item(client.direct(b"x" * (bound + 1), worker_rt.instance_id))
    assert info.value.limit == bound and info.value.size > bound  # the payload, framed
    assert (await first_item(client.direct(b"small", worker_rt.instance_id))) == "ok"
    assert calls == [b"small"]


async def connect_worker(url: str, buffer: str) -> tuple[DistributedRuntime | None, Any]:
    """The worker's NATS connection: the runtime's own (nats-py buffers 2 MiB while
    disconnected), or a bare one with a 16 KiB buffer and the runtime's flush timeout, on
    which a forced flush often coincides with the disconnect (without the timeout that
    publish would wait for the broker to come back)."""
    if buffer == "runtime":
        worker = await DistributedRuntime.connect(url, lease_ttl=LEASE_TTL, name="outage")
        return worker, worker.nc
    nc = await nats.connect(
        url,
        pending_size=16 * 1024,
        flush_timeout=PUBLISH_FLUSH_TIMEOUT_S,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.1,
    )
    return None, nc


async def start_stream(client_nc: Any, subject: str) -> None:
    """Send a request to `subject` until its first response frame arrives (NATS may
    answer "no responders" while a fresh subscription is still propagating; the runtime's
    own client then places the request again, as this does)."""
    frames: asyncio.Queue[bool] = asyncio.Queue()

    async def on_message(msg: Any) -> None:
        frames.put_nowait(not msg.headers)  # False: NATS' "no responders" status

    inbox = client_nc.new_inbox()
    await client_nc.subscribe(inbox, cb=on_message)
    deadline = asyncio.get_running_loop().time() + STEP_TIMEOUT_S
    while True:
        await client_nc.publish(subject, wire.encode_request("r1", None), reply=inbox)
        remaining = deadline - asyncio.get_running_loop().time()
        if await asyncio.wait_for(frames.get(), max(remaining, 0.01)):
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("buffer", ["runtime", "small"])
async def test_a_full_outbound_buffer_during_an_outage_cancels_the_handler(buffer: str) -> None:
    server = NatsServer().start()
    probe = Probe()
    yielded = 0

    async def endless(request: Any, ctx: Context) -> AsyncIterator[bytes]:
        nonlocal yielded
        try:
            while True:
                yielded += 1
                yield b"t" * 4096
                await asyncio.sleep(0 if buffer == "runtime" else 0.002)
        finally:
            probe.closed.set()

    worker, worker_nc = await connect_worker(server.url, buffer)
    client_nc = await nats.connect(server.url, max_reconnect_attempts=-1)
    endpoint = EndpointServer(worker_nc, "faults.outage.generate", 1, endless)
    try:
        await endpoint.start()
        await worker_nc.flush()
        await start_stream(client_nc, endpoint.subject)

        await asyncio.to_thread(server.stop)  # the broker goes away mid-stream
        await asyncio.wait_for(probe.closed.wait(), STEP_TIMEOUT_S)
        await wait_until_async(
            lambda: endpoint.in_flight == 0,
            timeout=STEP_TIMEOUT_S,
            what="the abandoned request to leave the endpoint",
        )
        stopped_at = yielded
        await asyncio.sleep(0.05)
        assert yielded == stopped_at  # the handler generates nothing more
    finally:
        # Nobody to deregister from or flush to: every close is bounded.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client_nc.close(), 2)
        await endpoint.drain(0)
        if worker is not None:
            await asyncio.wait_for(worker.abandon(), STEP_TIMEOUT_S)
        else:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(worker_nc.close(), 2)
        server.close()


# ----------------------------------------------------------------------- typed refusals


async def test_an_invalid_request_reaches_the_client_with_its_kind_and_message(
    worker_rt: DistributedRuntime, client_rt: DistributedRuntime, namespace: str
) -> None:
    async def picky(request: Any, ctx: Context) -> AsyncIterator[Any]:
        raise InvalidRequestError("top_p must be in (0, 1], got 0.0.")
        yield  # pragma: no cover - makes this an async generator

    await serve(worker_rt, namespace, picky)
    client = await client_of(client_rt, namespace)
    with pytest.raises(RemoteError) as info:
        await drain(client.direct(None, worker_rt.instance_id))
    assert info.value.kind is ErrorKind.INVALID_REQUEST
    assert info.value.message == "top_p must be in (0, 1], got 0.0."


@pytest.mark.parametrize("outputs_first", [0, 1])
async def test_a_handler_refusing_for_load_is_overloaded_only_before_any_output(
    worker_rt: DistributedRuntime, client_rt: DistributedRuntime, namespace: str, outputs_first: int
) -> None:
    async def full(request: Any, ctx: Context) -> AsyncIterator[Any]:
        for i in range(outputs_first):
            yield i
        raise WorkerOverloadedError("the engine's queue is full")

    await serve(worker_rt, namespace, full)
    client = await client_of(client_rt, namespace)
    stream = client.direct(None, worker_rt.instance_id)
    if outputs_first == 0:
        with pytest.raises(InstanceOverloadedError, match="queue is full"):
            await drain(stream)
    else:
        assert (await first_item(stream)) == 0
        with pytest.raises(RemoteError) as info:
            await drain(stream)
        assert info.value.kind is ErrorKind.INTERNAL
        assert info.value.remote_type == "WorkerOverloadedError"


# ----------------------------------------------------------------------- lost requests


async def test_a_request_lost_on_its_way_fails_fast_and_a_slow_handler_does_not(
    worker_rt: DistributedRuntime, client_rt: DistributedRuntime, namespace: str
) -> None:
    """The worker confirms each request as it reaches the handler (an ACCEPTED frame), so
    a request NATS lost on its way (here: the instance's subscription swallows it, as a
    node failing mid-route does) fails within the accept timeout as
    `RequestNotAcceptedError`, not after the first-output deadline; a STOP goes out in
    case it did arrive, and the instance is paused. A handler slower than the accept
    timeout to produce its first item is not failed: the confirmation came at once."""
    probe = Probe()

    async def slow(request: Any, ctx: Context) -> AsyncIterator[str]:
        await asyncio.sleep(1.0)  # longer than the accept timeout below
        yield "late"

    served = await serve(worker_rt, namespace, slow)
    client = await client_of(client_rt, namespace)
    instance = worker_rt.instance_id
    stream = client.direct(b"x", instance, accept_timeout=0.3, first_item_timeout=STEP_TIMEOUT_S)
    assert await drain(stream) == ["late"]

    assert served.server is not None
    subject = served.server.subject
    swallowed: list[bytes] = []
    stops: list[bytes] = []

    async def swallow(msg: Any) -> None:
        swallowed.append(msg.data)

    async def record_stop(msg: Any) -> None:
        stops.append(msg.data)
        probe.closed.set()

    # The swallowing subscription first, then the handler's goes: the subject never
    # has no subscriber at all.
    await worker_rt.nc.subscribe(subject, cb=swallow)
    await worker_rt.nc.subscribe(naming.control_subject(instance), cb=record_stop)
    await worker_rt.nc.flush()
    await served.server.stop_accepting()
    await worker_rt.nc.flush()
    for _ in range(3):
        started = asyncio.get_running_loop().time()
        lost = client.direct(b"y", instance, accept_timeout=0.3, first_item_timeout=STEP_TIMEOUT_S)
        try:
            await first_item(lost)
        except NoResponderError:
            # Seen once in a full suite on a loaded host (and once in 12 runs of this test
            # alone with the cores busy, never since in 100): NATS answered that the
            # subject had no subscriber when the request came, cause not pinned (a
            # reconnect of the worker's connection after missed pings would do it). That
            # fails fast too, but is not what this test is about: send again.
            await asyncio.sleep(0.5)
            continue
        except RequestNotAcceptedError as exc:
            assert "did not confirm the request" in str(exc)
            break
        pytest.fail("a request no handler saw produced an item")
    else:
        pytest.fail("three requests in a row found no subscriber on the instance's subject")
    assert asyncio.get_running_loop().time() - started < STEP_TIMEOUT_S / 2
    await lost.aclose()
    assert len(swallowed) == 1  # it did reach NATS: only the handler never saw it
    await asyncio.wait_for(probe.closed.wait(), STEP_TIMEOUT_S)
    assert len(stops) == 1
    assert instance not in client.routable_ids()  # paused, as after a "no responders"
