"""Worker side of the KV router's NATS plumbing: cache events and load reports out.

* `KvEventPublisher` puts a worker's `RouterEvent`s on its JetStream subject
  (`subjects.kv_events_subject`). It is the callback a `KvEventRelay` (vLLM) or the mocker
  engine hands events to.
* `LoadPublisher` publishes `LoadMetrics` snapshots on the worker's core subject when the
  engine says its load may have changed (after a step), and at least every `interval_s`,
  so routers see load without polling and can tell a live worker's stale report from a
  fresh one.

Engine-agnostic on purpose: where the events and the load numbers come from (vLLM's ZMQ
publisher and stat logger, or a simulation) is the caller's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Protocol

from dynamo.llm.kv_router.subjects import (
    KV_EVENTS_MAX_AGE_S,
    KV_EVENTS_STREAM,
    kv_events_stream_subjects,
    kv_events_subject,
    load_metrics_subject,
)
from dynamo.llm.protocols import (
    KvAllCleared,
    KvBlockRemoved,
    KvBlockStored,
    KvEventData,
    LoadMetrics,
    RouterEvent,
    encode,
)
from dynamo.runtime.backoff import Backoff, retry_until_done
from dynamo.runtime.events import EventStream
from dynamo.runtime.runtime import DistributedRuntime
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_LOAD_INTERVAL_S = 1.0
"""Longest time between two load reports of a live worker (routers ignore reports older
than five of these, `scheduler_defaults.DEFAULT_LOAD_METRICS_TTL_S`)."""
DEFAULT_LOAD_MIN_GAP_S = 0.05
"""Shortest time between two load reports: an engine stepping hundreds of times a second
reports at most this often, with the load of its latest step."""


def kv_events_stream() -> EventStream:
    """The stream every worker publishes to and every KV router replays."""
    return EventStream(KV_EVENTS_STREAM, kv_events_stream_subjects(), max_age_s=KV_EVENTS_MAX_AGE_S)


MAX_EVENTS_PER_MESSAGE = 64
"""Most events published together as one message of the stream (an engine step's events
rarely reach it; a long prompt's `KvBlockStored` holds a few hundred hashes, so 64 of
them stay far below NATS' default 1 MB message limit)."""

RESYNC_CHUNK_BLOCKS = 4096
"""Most block hashes in one `KvBlockStored` of a re-announcement (about 37 KB of
msgpack, far below NATS' default 1 MB message limit)."""


@dataclass(slots=True)
class PublisherStats:
    """What a `KvEventPublisher` did (logs, debug views, tests)."""

    published: int = 0  # events handed to `publish` that reached the stream
    purges: int = 0
    failures: int = 0
    resyncs: int = 0  # full re-announcements of the cache (after a failure or reconnect)
    streams_recreated: int = 0  # the stream was missing (broker restarted without store)


@dataclass(eq=False)
class KvEventPublisher:
    """Publishes one worker's KV events to its JetStream subject.

    Rules that keep what routers rebuild from the stream correct:

    * an `KvAllCleared` first purges the worker's subject: nothing before a clear can
      matter to a router replaying later, so the stream holds only the worker's current
      cache history (on start, the relay's opening clear drops what a previous process
      with the same id left);
    * the publisher mirrors the worker's cache from the events it is given (published or
      not), and whenever routers may have missed something it *re-announces* it: purge,
      `KvAllCleared`, then every cached block (`KvBlockStored` in chunks of
      `RESYNC_CHUNK_BLOCKS`). That happens before the next event after a failed publish
      (a lost removal would leave routers believing in a block that is gone), and after
      every reconnect to NATS, retried until it holds (a broker restarted without its
      store lost the stream; an idle worker may send no event for a long time, and a
      clear alone would make routers forget a shared prefix the worker still holds and
      will never announce again);
    * a failed publish checks the stream: when it was missing and had to be recreated,
      the event is published again at once (inside a re-announcement), rather than lost;
    * event ids on the wire are the caller's, raised where a re-announcement took ids,
      so they always increase per worker (routers drop an id they have seen).
    """

    runtime: DistributedRuntime
    namespace: InitVar[str]
    component: InitVar[str]
    worker_id: int
    _: KW_ONLY
    stream: EventStream = field(default_factory=kv_events_stream)
    backoff: Backoff | None = None  # None: `retry_until_done`'s default schedule
    subject: str = field(init=False)
    stats: PublisherStats = field(init=False, default_factory=PublisherStats)
    # The worker's cached blocks, as its events say.
    cached: set[int] = field(init=False, default_factory=set)
    # The last event id put on the wire.
    _last_id: int | None = field(init=False, default=None)
    _dirty: bool = field(init=False, default=False)
    _closed: bool = field(init=False, default=False)
    _lock: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)

    def __post_init__(self, namespace: str, component: str) -> None:
        self.subject = kv_events_subject(namespace, component, self.worker_id)

    async def start(self) -> KvEventPublisher:
        """Make sure the stream exists (idempotent); re-announce after every reconnect."""
        await self.stream.ensure(self.runtime)
        self.runtime.add_reconnect_listener(self.resync)
        return self

    def close(self) -> None:
        """Stop re-announcing on reconnect (the worker is leaving). Idempotent."""
        self._closed = True
        self.runtime.remove_reconnect_listener(self.resync)

    async def publish(self, event: RouterEvent) -> None:
        """Publish one event (in call order); raises when NATS did not take it."""
        await self.publish_many([event])

    async def publish_many(self, events: Sequence[RouterEvent]) -> None:
        """Publish consecutive events of the worker (in call order), as few messages as
        the rules allow: each run of events between clears is one message (up to
        `MAX_EVENTS_PER_MESSAGE`). Raises when NATS did not take them."""
        if not events:
            return
        async with self._lock:
            for event in events:  # the engine's truth, whether NATS takes it or not
                _apply(self.cached, event.data)
            try:
                await self._publish(events)
                return
            except Exception:
                self._dirty = True
                if not await self._recreated_stream():
                    self.stats.failures += len(events)
                    raise
            try:
                await self._publish(events)
            except Exception:
                self.stats.failures += len(events)
                raise

    async def resync(self) -> None:
        """Re-announce the whole cache now, retrying with backoff until it holds (the
        runtime calls this after every reconnect)."""
        await retry_until_done(
            self._resync_once,
            what=f"kv events: re-announcing the cache of worker {self.worker_id:016x}",
            backoff=self.backoff,
        )

    async def _resync_once(self) -> None:
        if self._closed:
            return
        async with self._lock:
            try:
                if await self.stream.ensure(self.runtime):
                    self._note_recreated()
                await self._announce_cache()
            except Exception:
                self._dirty = True
                raise
            self._dirty = False

    async def _recreated_stream(self) -> bool:
        """After a failed publish: whether the stream was missing and is now recreated
        (then publishing again can succeed). False when the broker is unreachable."""
        try:
            created = await self.stream.ensure(self.runtime)
        except Exception as exc:
            log.debug("kv events: stream check after a failed publish failed: %s", exc)
            return False
        if created:
            self._note_recreated()
        return bool(created)

    def _note_recreated(self) -> None:
        self.stats.streams_recreated += 1
        log.warning(
            "kv events: stream %s was missing (broker restarted without its store); recreated it",
            self.stream.name,
        )

    async def _publish(self, events: Sequence[RouterEvent]) -> None:
        if self._dirty and not any(isinstance(e.data, KvAllCleared) for e in events):
            # Routers may have missed events: tell them everything, these events included
            # (the mirror already holds their effect).
            await self._announce_cache()
            log.warning("kv events: publishing resumed, re-announced the cache to routers")
        else:
            run: list[RouterEvent] = []
            for event in events:
                if isinstance(event.data, KvAllCleared):
                    await self._send_run(run)
                    run = []
                    await self._purge()
                    await self._send(event.data, event.event_id)
                else:
                    run.append(event)
            await self._send_run(run)
        self._dirty = False
        self.stats.published += len(events)

    async def _announce_cache(self) -> None:
        await self._purge()
        await self._send(KvAllCleared())
        blocks = sorted(self.cached)
        for start in range(0, len(blocks), RESYNC_CHUNK_BLOCKS):
            chunk = blocks[start : start + RESYNC_CHUNK_BLOCKS]
            await self._send(KvBlockStored(block_hashes=chunk))
        self.stats.resyncs += 1

    async def _purge(self) -> None:
        await self.stream.purge_subject(self.runtime, self.subject)
        self.stats.purges += 1

    async def _send(self, data: KvEventData, event_id: int | None = None) -> None:
        """Put one event on the wire with an id above every id sent before."""
        event = self._numbered(data, event_id)
        await self.stream.publish(self.runtime, self.subject, encode(event))
        self._last_id = event.event_id

    async def _send_run(self, run: Sequence[RouterEvent]) -> None:
        """Put events on the wire as messages of up to `MAX_EVENTS_PER_MESSAGE`, ids
        raised as `_send` does."""
        for start in range(0, len(run), MAX_EVENTS_PER_MESSAGE):
            chunk = run[start : start + MAX_EVENTS_PER_MESSAGE]
            if len(chunk) == 1:
                await self._send(chunk[0].data, chunk[0].event_id)
                continue
            last_id = self._last_id
            numbered = []
            for event in chunk:
                numbered.append(self._numbered(event.data, event.event_id, last_id))
                last_id = numbered[-1].event_id
            await self.stream.publish(self.runtime, self.subject, encode(numbered))
            self._last_id = last_id

    def _numbered(
        self, data: KvEventData, event_id: int | None, after: int | None = None
    ) -> RouterEvent:
        """The event as it goes on the wire: its id, raised above `after` (default: the
        last id sent) where a re-announcement took ids."""
        last = self._last_id if after is None else after
        floor = -1 if last is None else last + 1
        return RouterEvent(
            self.worker_id, max(floor, event_id if event_id is not None else floor), data
        )


def _apply(cached: set[int], data: KvEventData) -> None:
    """Update a mirror of a worker's cache with one of its events."""
    if isinstance(data, KvBlockStored):
        cached.update(data.block_hashes)
    elif isinstance(data, KvBlockRemoved):
        cached.difference_update(data.block_hashes)
    else:
        cached.clear()


class CorePublisher(Protocol):
    """What `LoadPublisher` needs from the runtime (core NATS publish)."""

    async def publish(self, subject: str, data: bytes) -> None: ...


LoadSource = Callable[[], LoadMetrics]
Clock = Callable[[], float]
"""Monotonic seconds; only differences between two readings matter."""


class LoadPublisher:
    """Publishes a worker's `LoadMetrics` on its core subject: soon after the engine says
    its load may have changed (`changed()`, called after each engine step), and at least
    every `interval_s` (a heartbeat routers can age out).

    Event-driven rather than sampled on a timer: an idle worker costs one wake-up per
    heartbeat, and a busy one reports within a step of a change instead of within a
    polling period. `min_gap_s` bounds the rate: a change within `min_gap_s` of the last
    report waits out the gap, then goes out as the load at that moment.

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
        min_gap_s: float = DEFAULT_LOAD_MIN_GAP_S,
        clock: Clock = time.monotonic,
    ) -> None:
        if interval_s <= 0 or min_gap_s <= 0:
            raise ValueError("interval_s and min_gap_s must be positive")
        self._runtime = runtime
        self.subject = load_metrics_subject(namespace, component, worker_id)
        self._source = source
        self._interval = interval_s
        self._min_gap = min(min_gap_s, interval_s)
        self._clock = clock
        self._last: LoadMetrics | None = None
        self._last_sent = 0.0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        self.failures = 0

    def changed(self) -> None:
        """The engine's load may have changed: sample and report it within `min_gap_s`.
        Cheap enough to call after every engine step; call it on the event loop's thread."""
        self._changed.set()

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
        except Exception as exc:  # broker away: the next change or heartbeat tries again
            self.failures += 1
            log.debug("load metrics not published: %s", exc)
            return False
        self._last, self._last_sent = metrics, now
        self.published += 1
        return True

    async def _run(self) -> None:
        while True:
            heartbeat_in = self._interval - (self._clock() - self._last_sent)
            if heartbeat_in > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(heartbeat_in):
                        await self._changed.wait()
            self._changed.clear()
            await self.publish_if_due()
            await asyncio.sleep(self._min_gap)  # later changes wait out the gap, together
