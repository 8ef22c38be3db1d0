"""Frames of many streams ready in one event-loop turn travel as one NATS message per
reading process (`ReplyCoalescer` in the worker, the MUX unpacking in `Inbox`), against
a real nats-server.

Claims: when an "engine step" advances every stream at once, each stream still gets all
its items, in order, and the worker publishes several times fewer messages than frames;
streams read by two processes are grouped per process and each gets only its own; when
the worker's connection loses the frames that end its streams, the readers wait, and the
late ENDs the worker sends once reconnected turn that wait into `FramesLostError` (a cut
stream, which the frontend places again or migrates).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamo.runtime import Client, Context, DistributedRuntime, FramesLostError, ServedEndpoint

pytestmark = pytest.mark.integration

STEPS = 20
TIMEOUT_S = 10.0


class SteppedEngine:
    """Advances every running request by one output per `step()`, like a batch engine."""

    def __init__(self) -> None:
        self._tick = asyncio.Event()
        self.running = 0

    async def step(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()
        await asyncio.sleep(0.01)  # the outputs reach their streams

    async def generate(self, request: dict[str, Any], ctx: Context) -> AsyncIterator[Any]:
        self.running += 1
        try:
            for i in range(STEPS):
                await self._tick.wait()
                yield {"stream": request["stream"], "i": i}
        finally:
            self.running -= 1


@pytest.fixture
async def runtimes(nats_url: str) -> AsyncIterator[list[DistributedRuntime]]:
    rts = [
        await DistributedRuntime.connect(nats_url, lease_ttl=5.0, name=f"mux-{i}") for i in range(3)
    ]
    yield rts
    for rt in rts:
        await rt.shutdown(drain_timeout=0.5)


async def serve(
    worker: DistributedRuntime, namespace: str, engine: SteppedEngine
) -> ServedEndpoint:
    endpoint = worker.namespace(namespace).component("mux").endpoint("generate")
    return await endpoint.serve(engine.generate)


async def one_reader(
    worker: DistributedRuntime, reader: DistributedRuntime
) -> tuple[SteppedEngine, ServedEndpoint, Client]:
    """An engine served by `worker` in a namespace of its own, and `reader`'s client of it."""
    namespace = "mux" + uuid.uuid4().hex[:8]
    engine = SteppedEngine()
    served = await serve(worker, namespace, engine)
    assert served.server is not None
    return engine, served, await client_of(reader, namespace)


async def client_of(rt: DistributedRuntime, namespace: str) -> Client:
    client = await rt.namespace(namespace).component("mux").endpoint("generate").client()
    await client.wait_for_instances(timeout=TIMEOUT_S)
    return client


async def run_streams(
    engine: SteppedEngine, clients: list[Client], per_client: int, instance: int
) -> list[list[Any]]:
    """Open `per_client` streams on each client, step the engine until they end, and
    return what each stream received."""
    streams = [
        client.direct({"stream": f"{c}-{s}"}, instance)
        for c, client in enumerate(clients)
        for s in range(per_client)
    ]
    readers = [asyncio.ensure_future(_collect(stream)) for stream in streams]
    deadline = asyncio.get_running_loop().time() + TIMEOUT_S
    while engine.running < len(streams):
        assert asyncio.get_running_loop().time() < deadline, engine.running
        await asyncio.sleep(0.01)
    for _ in range(STEPS):
        await engine.step()
    return await asyncio.wait_for(asyncio.gather(*readers), TIMEOUT_S)


async def _collect(stream: Any) -> list[Any]:
    return [item async for item in stream]


def expected(stream: str) -> list[dict[str, Any]]:
    return [{"stream": stream, "i": i} for i in range(STEPS)]


async def test_one_step_of_many_streams_is_one_message(runtimes: list[DistributedRuntime]) -> None:
    worker = runtimes[0]
    engine, served, client = await one_reader(worker, runtimes[1])

    received = await run_streams(engine, [client], 12, worker.instance_id)

    assert received == [expected(f"0-{s}") for s in range(12)]
    coalescer = served.server.coalescer
    assert coalescer.frames_published >= 12 * (STEPS + 1)  # every item, every END
    assert coalescer.messages_published * 4 <= coalescer.frames_published, (
        coalescer.messages_published,
        coalescer.frames_published,
    )


async def test_two_readers_each_get_only_their_own_streams(
    runtimes: list[DistributedRuntime],
) -> None:
    worker = runtimes[0]
    namespace = "mux" + uuid.uuid4().hex[:8]
    engine = SteppedEngine()
    served = await serve(worker, namespace, engine)
    assert served.server is not None
    clients = [await client_of(rt, namespace) for rt in runtimes[1:]]

    received = await run_streams(engine, clients, 6, worker.instance_id)

    assert received == [expected(f"{c}-{s}") for c in range(2) for s in range(6)]
    coalescer = served.server.coalescer
    assert coalescer.messages_published >= 2 * STEPS  # one per reader per step at least
    assert coalescer.messages_published * 3 <= coalescer.frames_published


async def test_ends_lost_with_the_workers_connection_are_noticed_after_it_reconnects(
    runtimes: list[DistributedRuntime], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = runtimes[0]
    engine, served, client = await one_reader(worker, runtimes[1])
    streams = [client.direct({"stream": f"lost-{s}"}, worker.instance_id) for s in range(3)]
    readers = [asyncio.ensure_future(_collect(stream)) for stream in streams]
    while engine.running < len(streams):
        await asyncio.sleep(0.01)
    for _ in range(STEPS - 1):
        await engine.step()

    async def lost(subject: str, payload: bytes = b"", **kwargs: Any) -> None:
        """What the server never got: written just before the connection dropped."""

    with monkeypatch.context() as patch:
        patch.setattr(worker.nc, "publish", lost)
        await engine.step()  # the last items and the ENDs go nowhere
        while engine.running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert not any(r.done() for r in readers), "without the late ENDs they would wait on"

    assert served.server.coalescer.probe_recent_ends() == len(streams)  # on reconnect
    for r in readers:
        with pytest.raises(FramesLostError):
            await asyncio.wait_for(r, TIMEOUT_S)
