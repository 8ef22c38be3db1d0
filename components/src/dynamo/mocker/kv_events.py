"""Forwards a simulated engine's cache events to the KV router's NATS stream.

The engine reports each step's events synchronously (it must never wait on the network
inside a step); this forwarder numbers them as `RouterEvent`s and publishes them in order
from a task of its own through the same `KvEventPublisher` the vLLM worker's relay uses,
each step's events together (`publish_many`: one message of the stream per step).
Like that relay it opens with `KvAllCleared`, which purges whatever an earlier process
left on the subject and restarts the worker's event sequence in every router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from dynamo.llm.protocols import KvAllCleared, KvEventData, RouterEvent

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 2.0
"""How long `stop` waits for the publishing task to end."""


class EventPublisher(Protocol):
    """What the forwarder needs (`dynamo.llm.kv_router.publisher.KvEventPublisher`)."""

    async def publish_many(self, events: Sequence[RouterEvent]) -> None: ...


class KvEventForwarder:
    """Numbers and publishes one worker's cache events, in order, off the step loop."""

    def __init__(self, publisher: EventPublisher, worker_id: int) -> None:
        self._publisher = publisher
        self.worker_id = worker_id
        # None is the stop sentinel.
        self._queue: asyncio.Queue[list[KvEventData] | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._next_event_id = 0
        self._pending = 0
        self._closed = False
        self.published = 0
        self.failures = 0

    def start(self) -> KvEventForwarder:
        """Announce an empty cache and start publishing."""
        if self._task is not None:
            raise RuntimeError("forwarder already started")
        self.submit([KvAllCleared()])
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.worker_id:x}")
        return self

    def submit(self, events: list[KvEventData]) -> None:
        """Queue one step's events (the engine's `on_kv_events` callback)."""
        if events:
            self._pending += len(events)
            self._queue.put_nowait(events)

    @property
    def idle(self) -> bool:
        """Every submitted event has been published (or failed)."""
        return self._pending == 0

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every submitted event went out; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.idle:
            if loop.time() > deadline or self._task is None or self._task.done():
                return False
            await asyncio.sleep(0.005)
        return True

    async def stop(self) -> None:
        """Stop publishing; events not yet sent are dropped (the worker is leaving and
        routers forget its blocks with its lease).

        Cancelling is not enough on its own: on Python 3.11 `asyncio.wait_for` (which
        nats-py's request uses for the JetStream ack) swallows a cancellation that lands
        as the ack arrives, and the task would then wait on the queue forever. So the
        loop also gets a sentinel, and the wait is bounded."""
        task, self._task = self._task, None
        if task is None:
            return
        self._closed = True
        task.cancel()
        self._queue.put_nowait(None)
        done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
        if not done:
            log.warning("kv events of %x: publisher task did not stop", self.worker_id)

    async def _run(self) -> None:
        while not self._closed:
            events = await self._queue.get()
            if events is None:
                return
            first = self._next_event_id
            batch = [RouterEvent(self.worker_id, first + i, data) for i, data in enumerate(events)]
            self._next_event_id += len(batch)
            try:
                await self._publisher.publish_many(batch)
                self.published += len(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The publisher resynchronises routers with a clear once NATS is back.
                self.failures += len(batch)
                log.warning(
                    "kv events %d..%d not published: %s", first, first + len(batch) - 1, exc
                )
            finally:
                self._pending -= len(batch)
