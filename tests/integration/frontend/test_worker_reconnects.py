"""A worker whose NATS connection drops and comes back loses no request.

When a NATS cluster loses a node, the workers connected to it reconnect to another one;
until they have, their subscriptions are gone and NATS answers "no responders" for them,
while their keys (leased for 18 s on a cluster) keep them registered. A frontend that
takes such an answer as a dead worker fails every request meanwhile (503 "no worker"), the
failure CI met once in the node-loss test. Claims, over a real nats-server, with the
worker connected through a TCP proxy the test cuts and restores (so the outage is
controlled, not a race):

* requests sent while the only worker is unreachable wait and are served once it is back:
  none fails, at least one met "no responders" and was sent again, and each is charged no
  placement for it (the worker is its only instance);
* the worker's key never left the bucket (no re-registration was needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
from nats.errors import NoRespondersError

from dynamo.frontend.engine.client import PLACEMENT_RETRY, RuntimeEngineClient
from dynamo.llm.protocols import FinishReason, LLMEngineOutput, PreprocessedRequest
from dynamo.llm.router import RoundRobinRouter
from dynamo.runtime import Context, DistributedRuntime
from dynamo.testing.waiting import wait_until_async

pytestmark = pytest.mark.integration

LEASE_TTL_S = 10.0  # long enough that the outage never expires the worker's key
STEP_TIMEOUT_S = 20.0
REQUESTS = 6
DONE = LLMEngineOutput(token_ids=[7], finish_reason=FinishReason.EOS)


class CuttableProxy:
    """A TCP proxy to a nats-server: `cut()` closes every connection through it and
    refuses new ones until `restore()`."""

    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 4222)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.refusing = False

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"nats://127.0.0.1:{port}"

    def cut(self) -> None:
        self.refusing = True
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def restore(self) -> None:
        self.refusing = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers.update((writer, up_writer))
        await asyncio.gather(
            self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
        )

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            self._writers.discard(writer)
            writer.close()


async def answer(_request: Any, _ctx: Context) -> AsyncIterator[LLMEngineOutput]:
    yield DONE


@pytest.fixture
async def proxy(nats_url: str) -> AsyncIterator[CuttableProxy]:
    proxy = CuttableProxy(nats_url)
    yield proxy
    await proxy.close()


async def no_responder_for(url: str, subject: str) -> None:
    """Return once NATS answers "no responders" on `subject` (the worker's interest is
    gone from the server)."""
    nc = await nats.connect(url)
    try:

        async def gone() -> bool:
            try:
                await nc.request(subject, b"", timeout=0.5)
            except NoRespondersError:
                return True
            except TimeoutError:
                return False
            return False

        await wait_until_async(gone, timeout=STEP_TIMEOUT_S, what=f"no responders on {subject}")
    finally:
        await nc.close()


async def test_requests_wait_out_a_reconnecting_worker_and_are_served(
    nats_url: str, proxy: CuttableProxy
) -> None:
    namespace = "reconnect" + uuid.uuid4().hex[:8]
    worker = await DistributedRuntime.connect(
        await proxy.start(), lease_ttl=LEASE_TTL_S, name="reconnecting-worker"
    )
    caller = await DistributedRuntime.connect(nats_url, lease_ttl=LEASE_TTL_S, name="caller")
    try:
        endpoint = worker.namespace(namespace).component("backend").endpoint("generate")
        await endpoint.serve(answer)
        client = (
            await caller.namespace(namespace)
            .component("backend")
            .endpoint("generate")
            .client(wait_for_instances=STEP_TIMEOUT_S)
        )
        placements: list[str] = []
        engine = RuntimeEngineClient(
            client, RoundRobinRouter(), on_routed=lambda _m, _t, kind, _o: placements.append(kind)
        )

        async def one(index: int) -> list[LLMEngineOutput]:
            request = PreprocessedRequest(request_id=f"r{index}", model="m", token_ids=[1, 2])
            return [output async for output in engine.generate(request)]

        assert await one(-1) == [DONE]
        subject = client.request_subject(worker.instance_id)
        proxy.cut()
        await no_responder_for(nats_url, subject)
        tasks = [asyncio.create_task(one(i)) for i in range(REQUESTS)]
        await wait_until_async(
            lambda: PLACEMENT_RETRY in placements or any(task.done() for task in tasks),
            timeout=STEP_TIMEOUT_S,
            what="a request to meet no responders and be sent again",
        )
        assert not any(task.done() for task in tasks), [t.exception() for t in tasks if t.done()]
        proxy.restore()
        results = await asyncio.wait_for(asyncio.gather(*tasks), STEP_TIMEOUT_S)
        assert results == [[DONE]] * REQUESTS
        assert client.instance_ids() == [worker.instance_id]
    finally:
        with contextlib.suppress(Exception):
            await caller.shutdown(drain_timeout=0.5)
        proxy.restore()
        with contextlib.suppress(Exception):
            await worker.shutdown(drain_timeout=0.5)
