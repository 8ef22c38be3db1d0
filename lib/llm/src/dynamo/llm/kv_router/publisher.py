"""Worker side of the KV router's NATS plumbing: cache events and load reports out.

* `KvEventPublisher` puts a worker's `RouterEvent`s on its JetStream subject
  (`subjects.kv_events_subject`). It is the callback a `KvEventRelay` (vLLM) or the mocker
  engine hands events to.
* `LoadPublisher` publishes `LoadMetrics` snapshots on the worker's core subject, on change
  and at least every `interval_s`, so routers see load without polling and can tell a
  live worker's stale report from a fresh one.

Engine-agnostic on purpose: where the events and the load numbers come from (vLLM's ZMQ
publisher and stat logger, or a simulation) is the caller's business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dynamo.llm.kv_router.subjects import (
    KV_EVENTS_MAX_AGE_S,
    KV_EVENTS_STREAM,
    kv_events_stream_subjects,
    kv_events_subject,
    load_metrics_subject,
)
from dynamo.llm.protocols import KvAllCleared, LoadMetrics, RouterEvent, encode
from dynamo.runtime.events import EventStream
from dynamo.runtime.runtime import DistributedRuntime
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_LOAD_INTERVAL_S = 0.25
"""Longest time between two load reports of a live worker."""
DEFAULT_LOAD_POLL_S = 0.05
"""How often the load source is sampled for changes (reported at once when changed)."""


def kv_events_stream() -> EventStream:
    """The stream every worker publishes to and every KV router replays."""
    return EventStream(KV_EVENTS_STREAM, kv_events_stream_subjects(), max_age_s=KV_EVENTS_MAX_AGE_S)


@dataclass(slots=True)
class PublisherStats:
    """What a `KvEventPublisher` did (logs, debug views, tests)."""

    published: int = 0
    purges: int = 0
    failures: int = 0
    resyncs: int = 0  # cleared announcements added after a failed publish


class KvEventPublisher:
    """Publishes one worker's KV events to its JetStream subject.

    Two rules keep what routers rebuild from the stream correct:

    * an `KvAllCleared` first purges the worker's subject: nothing before a clear can
      matter to a router replaying later, so the stream holds only the worker's current
      cache history (on start, the relay's opening clear drops what a previous process
      with the same id left);
    * after a failed publish (broker away), the next successful one is preceded by a
      `KvAllCleared`: a lost removal would leave routers believing in a block that is
      gone, while forgetting blocks only costs cache hits.
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        namespace: str,
        component: str,
        worker_id: int,
        *,
        stream: EventStream | None = None,
    ) -> None:
        self._runtime = runtime
        self._stream = stream or kv_events_stream()
        self.subject = kv_events_subject(namespace, component, worker_id)
        self.worker_id = worker_id
        self.stats = PublisherStats()
        self._dirty = False
        self._lock = asyncio.Lock()

    async def start(self) -> KvEventPublisher:
        """Make sure the stream exists (idempotent)."""
        await self._stream.ensure(self._runtime)
        return self

    async def publish(self, event: RouterEvent) -> None:
        """Publish one event (in call order); raises when NATS did not take it."""
        async with self._lock:
            try:
                await self._publish(event)
            except Exception:
                self._dirty = True
                self.stats.failures += 1
                raise

    async def _publish(self, event: RouterEvent) -> None:
        cleared = isinstance(event.data, KvAllCleared)
        if cleared or self._dirty:
            await self._stream.purge_subject(self._runtime, self.subject)
            self.stats.purges += 1
        if self._dirty and not cleared:
            # Ids only need to increase per worker; the clear restarts the sequence just
            # below the event that follows it.
            resync = RouterEvent(self.worker_id, event.event_id - 1, KvAllCleared())
            await self._stream.publish(self._runtime, self.subject, encode(resync))
            self.stats.resyncs += 1
            log.warning("kv events: publishing resumed, announced an empty cache to routers")
        await self._stream.publish(self._runtime, self.subject, encode(event))
        self._dirty = False
        self.stats.published += 1


class CorePublisher(Protocol):
    """What `LoadPublisher` needs from the runtime (core NATS publish)."""

    async def publish(self, subject: str, data: bytes) -> None: ...


LoadSource = Callable[[], LoadMetrics]
Clock = Callable[[], float]
"""Monotonic seconds; only differences between two readings matter."""


class LoadPublisher:
    """Publishes a worker's `LoadMetrics` on its core subject: whenever the sampled value
    changes, and at least every `interval_s` (a heartbeat routers can age out).

    `clock` decides when the heartbeat is due. It defaults to `time.monotonic` (what
    asyncio's own loop clock reads) and is a parameter so the change/heartbeat rules can be
    checked by calling `publish_if_due` with a hand-moved clock instead of waiting.
    """

    def __init__(
        self,
        runtime: CorePublisher,
        namespace: str,
        component: str,
        worker_id: int,
        source: LoadSource,
        *,
        interval_s: float = DEFAULT_LOAD_INTERVAL_S,
        poll_s: float = DEFAULT_LOAD_POLL_S,
        clock: Clock = time.monotonic,
    ) -> None:
        if interval_s <= 0 or poll_s <= 0:
            raise ValueError("interval_s and poll_s must be positive")
        self._runtime = runtime
        self.subject = load_metrics_subject(namespace, component, worker_id)
        self._source = source
        self._interval = interval_s
        self._poll = min(poll_s, interval_s)
        self._clock = clock
        self._last: LoadMetrics | None = None
        self._last_sent = 0.0
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        self.failures = 0

    async def start(self) -> LoadPublisher:
        """Publish the current load now and keep publishing in the background."""
        if self._task is not None:
            raise RuntimeError("load publisher already started")
        await self.publish_if_due(force=True)
        self._task = asyncio.create_task(self._run(), name="load-publisher")
        return self

    async def stop(self) -> None:
        """Stop publishing (idempotent); routers age the last report out."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def publish_if_due(self, *, force: bool = False) -> bool:
        """Sample the source; publish when it changed, the heartbeat is due, or `force`.
        Returns whether a report went out."""
        metrics = self._source()
        now = self._clock()
        due = now - self._last_sent >= self._interval
        if not (force or due or metrics != self._last):
            return False
        try:
            await self._runtime.publish(self.subject, encode(metrics))
        except Exception as exc:  # broker away: the next tick tries again
            self.failures += 1
            log.debug("load metrics not published: %s", exc)
            return False
        self._last, self._last_sent = metrics, now
        self.published += 1
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._poll)
            await self.publish_if_due()
