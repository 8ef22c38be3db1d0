"""Response streams never wait forever, against a real nats-server.

Claims: a stream with a first-item deadline fails with `StreamTimeoutError` when its
instance sends nothing in time, and one with an item deadline when the instance goes
silent after some items; either way the handler on the instance is cancelled (the STOP
reaches it). A steady stream slower than nothing but faster than its deadline is never
cut. Closing a `Client` ends every stream open through it at once with
`ClientClosedError` (a closed client no longer watches the instances, so it could not
report their loss) and cancels the handlers; a stream opened after the close is refused.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from dynamo.runtime import (
    Client,
    ClientClosedError,
    Context,
    DistributedRuntime,
    StreamTimeoutError,
)
from dynamo.testing.waiting import wait_until_async

LEASE_TTL = 5.0  # nothing here waits for a lease; long enough for a loaded host


@dataclass
class Scripted:
    """The serving side: what each request asked for and which handlers were cancelled."""

    started: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def handler(self, request: dict[str, Any], ctx: Context) -> AsyncIterator[dict]:
        """`{"delay": s, "items": n, "gap": s, "stall": bool}`: wait `delay`, send `n`
        items `gap` apart, then end, or stall forever (heartbeats go on)."""
        self.started.append(ctx.id)
        finished = False
        try:
            await asyncio.sleep(request.get("delay", 0.0))
            for i in range(request["items"]):
                if i:
                    await asyncio.sleep(request.get("gap", 0.0))
                yield {"i": i}
            if request.get("stall"):
                await asyncio.Event().wait()
            finished = True
        finally:
            if not finished:
                self.cancelled.append(ctx.id)


@dataclass
class Served:
    scripted: Scripted
    client: Client
    instance_id: int


@pytest.fixture
async def served(nats_url: str) -> AsyncIterator[Served]:
    namespace = "dl" + uuid.uuid4().hex[:8]
    server = await DistributedRuntime.connect(nats_url, lease_ttl=LEASE_TTL, name="dl-server")
    caller = await DistributedRuntime.connect(nats_url, lease_ttl=LEASE_TTL, name="dl-client")
    try:
        scripted = Scripted()
        endpoint = server.namespace(namespace).component("work").endpoint("generate")
        registration = await endpoint.serve(scripted.handler)
        client = await caller.namespace(namespace).component("work").endpoint("generate").client()
        await client.wait_for_instances(timeout=15)
        yield Served(scripted, client, registration.instance_id)
    finally:
        await caller.shutdown(drain_timeout=0)
        await server.shutdown(drain_timeout=0)


async def _cancelled(scripted: Scripted, request_id: str) -> None:
    await wait_until_async(
        lambda: request_id in scripted.cancelled,
        timeout=5,
        what=f"the handler of {request_id} to be cancelled",
    )


async def test_no_first_item_in_time_fails_and_cancels(served: Served) -> None:
    stream = served.client.direct(
        {"delay": 3600, "items": 1}, served.instance_id, request_id="r1", first_item_timeout=0.5
    )
    started = time.monotonic()
    with pytest.raises(StreamTimeoutError, match=r"sent no first output within 0\.5s"):
        await asyncio.wait_for(stream.__anext__(), 10)
    assert 0.45 < time.monotonic() - started < 8.0  # its own deadline, not the test's 10 s
    await stream.aclose()
    await _cancelled(served.scripted, "r1")


async def test_silence_after_items_fails_and_cancels(served: Served) -> None:
    request = {"items": 3, "stall": True}
    stream = served.client.direct(
        request, served.instance_id, request_id="r2", first_item_timeout=10, item_timeout=0.5
    )
    items = []
    with pytest.raises(StreamTimeoutError, match=r"sent no next output within 0\.5s") as info:
        async with asyncio.timeout(10):
            async for item in stream:
                items.append(item)
                last = time.monotonic()
    assert items == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert 0.45 < time.monotonic() - last < 8.0  # its own deadline, not the test's 10 s
    assert info.value.instance_id == served.instance_id
    await stream.aclose()
    await _cancelled(served.scripted, "r2")


async def test_steady_stream_within_its_deadlines_is_not_cut(served: Served) -> None:
    """Deadlines are per wait, not per stream: 12 items 0.1 s apart take 1.1 s, more
    than both limits, and arrive complete."""
    request = {"delay": 0.2, "items": 12, "gap": 0.1}
    stream = served.client.direct(
        request, served.instance_id, request_id="r3", first_item_timeout=0.6, item_timeout=0.6
    )
    items = [item async for item in stream]
    assert [item["i"] for item in items] == list(range(12))
    assert served.scripted.cancelled == []


async def test_closing_the_client_fails_its_open_streams_at_once(served: Served) -> None:
    stream = served.client.direct(
        {"items": 1, "stall": True}, served.instance_id, request_id="r4"
    )  # no deadline: only the close can end it
    assert await asyncio.wait_for(stream.__anext__(), 10) == {"i": 0}
    reader = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.05)  # the reader is waiting for a frame now
    assert not reader.done()
    await served.client.close()
    with pytest.raises(ClientClosedError, match="was closed"):  # not the wait's TimeoutError
        await asyncio.wait_for(reader, 5)
    await stream.aclose()
    await _cancelled(served.scripted, "r4")
    later = served.client.direct({"items": 1}, served.instance_id, request_id="r5")
    with pytest.raises(ClientClosedError):
        await later.__anext__()
    assert "r5" not in served.scripted.started
