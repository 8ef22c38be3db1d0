"""Router replica sync over NATS: `RouterReplicaSync`, a `KvRouter` attachment.

The rules (what is published, applied, expired and repaired) are `ReplicaBooks`'s; this
module only moves them over core NATS, on the endpoint's `subjects.router_sync_subject`:

* it observes the scheduler's own booking changes (`BookingObserver`) and queues them;
  a sender task publishes the queue once per event-loop wake-up, consecutive changes
  batched into one `BookingChanges` message, so a burst of requests costs a few
  publishes, not one each, and the order of one replica's messages is the order of its
  changes (NATS keeps one publisher's order);
* a beat task queues a heartbeat every interval and drops replicas that missed their
  beats;
* the subscription hands every other replica's message to `ReplicaBooks.receive` and
  queues its answers (snapshots);
* `start` queues a snapshot request (a new replica learns the others' bookings at
  once) and `close` publishes `ReplicaLeaving`, so the others release its bookings
  without waiting for missed heartbeats.

A publish that fails (broker away) loses those messages; the heartbeats after the
reconnect disagree with what the others hold, and they ask for a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from nats.aio.msg import Msg

from dynamo.llm.kv_router.replica_books import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_MISS_LIMIT,
    ReplicaBooks,
    hash_chunks,
)
from dynamo.llm.kv_router.scheduler import KvScheduler
from dynamo.llm.protocols import (
    BookingChange,
    BookingChanges,
    ReplicaLeaving,
    ReplicaSyncData,
    ReplicaSyncMessage,
    decode,
    encode,
)

log = logging.getLogger(__name__)

LEAVING_PUBLISH_TIMEOUT_S = 1.0
"""How long `close` waits to flush its goodbye (a broker away must not hold shutdown)."""


@dataclass(frozen=True, slots=True)
class ReplicaSyncSettings:
    """`--router-replica-sync` and its timing: heartbeat interval, and how many missed
    beats make a replica dead."""

    enabled: bool = True
    interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    miss_limit: int = DEFAULT_MISS_LIMIT

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.miss_limit < 1:
            raise ValueError("interval_s must be positive and miss_limit at least 1")


class SyncSubscription(Protocol):
    async def unsubscribe(self) -> None: ...


class SyncBus(Protocol):
    """What the sync needs of the runtime (`DistributedRuntime`): core NATS publish and
    subscribe."""

    async def publish(self, subject: str, data: bytes) -> None: ...

    async def subscribe(
        self, subject: str, callback: Callable[[Msg], Awaitable[None]], queue: str = ""
    ) -> SyncSubscription: ...


def new_replica_id() -> str:
    return uuid.uuid4().hex[:16]


class RouterReplicaSync:
    """Shares one `KvScheduler`'s bookings with the other replicas of its endpoint."""

    name = "replica_sync"

    def __init__(
        self,
        bus: SyncBus,
        scheduler: KvScheduler,
        subject: str,
        settings: ReplicaSyncSettings | None = None,
        *,
        replica_id: str | None = None,
    ) -> None:
        settings = settings or ReplicaSyncSettings()
        self._bus = bus
        self._scheduler = scheduler
        self.subject = subject
        self.books = ReplicaBooks(
            scheduler,
            replica_id or new_replica_id(),
            interval_s=settings.interval_s,
            miss_limit=settings.miss_limit,
        )
        self._outbox: list[ReplicaSyncData | BookingChange] = []
        self._wake = asyncio.Event()
        self._subscription: SyncSubscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.published = 0
        self.publish_failures = 0
        self.malformed = 0

    @property
    def replica_id(self) -> str:
        return self.books.replica_id

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> RouterReplicaSync:
        """Subscribe, observe the scheduler, ask the others for their bookings."""
        self._subscription = await self._bus.subscribe(self.subject, self._on_message)
        self._scheduler.add_booking_observer(self)
        self._queue(self.books.hello())
        self._queue(self.books.heartbeat())
        self._tasks = [
            asyncio.create_task(self._send(), name="replica-sync-send"),
            asyncio.create_task(self._beat(), name="replica-sync-beat"),
        ]
        log.info("kv router replica %s syncing bookings on %s", self.replica_id, self.subject)
        return self

    async def close(self) -> None:
        """Stop observing, publish what is queued and a goodbye, unsubscribe."""
        self._scheduler.remove_booking_observer(self)
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None
            self._queue(ReplicaLeaving())
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flush(), LEAVING_PUBLISH_TIMEOUT_S)

    def debug_state(self) -> dict[str, Any]:
        return {
            **self.books.debug_state(),
            "subject": self.subject,
            "published": self.published,
            "publish_failures": self.publish_failures,
            "malformed": self.malformed,
        }

    # ------------------------------------------------------------------ BookingObserver

    def booking_changed(self, change: BookingChange) -> None:
        if self.books.local_change(change):
            self._queue(change)

    # ------------------------------------------------------------------ internals

    def _queue(self, item: ReplicaSyncData | BookingChange) -> None:
        self._outbox.append(item)
        self._wake.set()

    async def _on_message(self, msg: Msg) -> None:
        try:
            message = decode(msg.data, ReplicaSyncMessage)
        except msgspec.MsgspecError as exc:
            self.malformed += 1
            log.warning("kv router replica sync: undecodable message on %s: %s", msg.subject, exc)
            return
        for answer in self.books.receive(message):
            self._queue(answer)

    async def _send(self) -> None:
        while True:
            await self._wake.wait()
            await self._flush()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.books.interval_s)
            self._queue(self.books.heartbeat())
            self.books.expire()

    async def _flush(self) -> None:
        """Publish everything queued, in order, consecutive changes batched."""
        self._wake.clear()
        items, self._outbox = self._outbox, []
        for data in _messages(items):
            try:
                payload = encode(ReplicaSyncMessage(self.replica_id, data))
                await self._bus.publish(self.subject, payload)
            except Exception as exc:  # broker away: heartbeats repair it later
                self.publish_failures += 1
                log.debug("kv router replica sync: publish failed: %s", exc)
            else:
                self.published += 1


def _messages(items: list[ReplicaSyncData | BookingChange]) -> list[ReplicaSyncData]:
    """Queued items as messages, in order: each run of booking changes becomes
    `BookingChanges` of at most `MAX_HASHES_PER_MESSAGE` hashes each (`hash_chunks`),
    everything else goes as it is."""
    messages: list[ReplicaSyncData] = []
    for is_change, run in itertools.groupby(items, lambda item: isinstance(item, BookingChange)):
        if is_change:
            messages += [BookingChanges(chunk) for chunk in hash_chunks(run)]
        else:
            messages += run
    return messages
