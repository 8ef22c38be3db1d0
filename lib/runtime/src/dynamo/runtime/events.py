"""Events: replayable JetStream streams and fire-and-forget core subjects.

* `EventStream` — a JetStream stream for events that a late subscriber must be able to
  replay (KV-cache events: a frontend that starts after the workers rebuilds its index
  from the stream). Bounded by age and size so it cannot grow without limit.
* `StreamSubscription` — an ordered push consumer from the start of the stream (or a given
  sequence), recreated after a broker reconnect from the last sequence it delivered, so
  nothing is applied twice and nothing is skipped while the stream still holds it. A
  broker restarted without its store has lost the stream: the subscription notices (the
  stream's creation time changed), tells its owner (`on_reset`: what it learnt from the
  old stream may be stale) and replays the new stream from its first sequence, since its
  sequence numbers restarted. The resubscription is retried with backoff until it holds.
* Core subjects (`DistributedRuntime.publish/subscribe`) carry periodic snapshots such as
  load metrics, where only the latest value matters.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError

from dynamo.runtime.backoff import Backoff, retry_until_done
from dynamo.runtime.kv import (
    is_replica_shortage,
    replica_error,
    retry_transient,
    wait_for_stream_leader,
    warn_replicas,
)
from dynamo.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

EventHandler = Callable[[str, bytes, int], Awaitable[None]]
"""handler(subject, payload, stream_sequence)"""
ResetHandler = Callable[[], None]
"""Called when the stream was recreated: everything delivered before may be stale."""


@dataclass(frozen=True)
class EventStream:
    """A JetStream stream capturing `subjects` (wildcards allowed)."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float = 3600.0
    max_bytes: int = 256 * 1024 * 1024

    def config(self, replicas: int = 1) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            storage=StorageType.FILE,
            num_replicas=replicas,
        )

    async def ensure(self, runtime: DistributedRuntime) -> bool:
        """Create the stream with the runtime's replica count if it does not exist
        (idempotent); True when this call created it (it was missing: first use, or a
        broker restarted without its store). ConfigError when the NATS servers cannot
        hold that many replicas. Retried through a cluster's transient unavailability."""
        return await retry_transient(lambda: self._ensure(runtime), what=f"stream {self.name}")

    async def _ensure(self, runtime: DistributedRuntime) -> bool:
        try:
            info = await runtime.js.stream_info(self.name)
        except NotFoundError:
            try:
                await runtime.js.add_stream(self.config(runtime.replicas))
                await wait_for_stream_leader(runtime.js, self.name, runtime.replicas)
                return True
            except APIError as exc:
                if is_replica_shortage(exc):
                    raise replica_error(f"stream {self.name}", runtime.replicas, exc) from None
                if not isinstance(exc, BadRequestError):
                    raise
                await runtime.js.stream_info(self.name)  # created concurrently
                return False
        warn_replicas(f"stream {self.name}", info.config.num_replicas or 1, runtime.replicas)
        return False

    async def identity(self, runtime: DistributedRuntime) -> StreamIdentity:
        """What tells this incarnation of the stream from a recreated one."""
        info = await runtime.js.stream_info(self.name)
        return StreamIdentity(created=info.created, last_sequence=info.state.last_seq)

    async def publish(self, runtime: DistributedRuntime, subject: str, payload: bytes) -> int:
        """Publish and wait for the stream's ack; returns the stream sequence."""
        ack = await runtime.js.publish(subject, payload, stream=self.name)
        return ack.seq

    async def purge_subject(self, runtime: DistributedRuntime, subject: str) -> None:
        """Drop every stored event of `subject` (e.g. a worker whose cache was reset)."""
        await runtime.js.purge_stream(self.name, subject=subject)


@dataclass(frozen=True)
class StreamIdentity:
    """A stream's creation time (and, for servers that do not report it, its last
    sequence): a stream recreated under the same name has a new one."""

    created: datetime.datetime | None
    last_sequence: int

    def replaced_by(self, now: StreamIdentity, delivered: int) -> bool:
        """Whether `now` is another stream than this one, given that sequences up to
        `delivered` were delivered from this one."""
        if self.created is not None and now.created is not None:
            return now.created != self.created
        return now.last_sequence < delivered  # sequences never go back within one stream


@dataclass(eq=False)
class StreamSubscription:
    """Delivers every event of `subject_filter` in `stream` to `handler`, in order."""

    runtime: DistributedRuntime
    stream: EventStream
    subject_filter: str
    handler: EventHandler
    _: KW_ONLY
    start_sequence: InitVar[int] = 1
    on_reset: ResetHandler | None = None
    backoff: Backoff | None = None  # None: `retry_until_done`'s default schedule
    last_sequence: int = field(init=False)
    resets: int = field(init=False, default=0)  # times the stream was found recreated
    _identity: StreamIdentity | None = field(init=False, default=None)
    _sub: Any = field(init=False, default=None)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self, start_sequence: int) -> None:
        self.last_sequence = start_sequence - 1

    async def start(self) -> StreamSubscription:
        await self.stream.ensure(self.runtime)
        self._identity = await self.stream.identity(self.runtime)
        await self._subscribe()
        self.runtime.add_reconnect_listener(self._resubscribe)
        return self

    async def _subscribe(self) -> None:
        self._sub = await self.runtime.js.subscribe(
            self.subject_filter,
            stream=self.stream.name,
            cb=self._on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            config=_start_at(self.last_sequence + 1),
        )

    async def _resubscribe(self) -> None:
        """The reconnect listener: resubscribe, retrying until it holds (a router left
        without its subscription would never learn another event)."""
        await retry_until_done(
            self._resubscribe_once,
            what=f"resubscribing to {self.stream.name} ({self.subject_filter})",
            backoff=self.backoff,
        )

    async def _resubscribe_once(self) -> None:
        if self._closed:
            return
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        await self.stream.ensure(self.runtime)
        identity = await self.stream.identity(self.runtime)
        known, self._identity = self._identity, identity
        if known is not None and known.replaced_by(identity, self.last_sequence):
            self._reset()
        await self._subscribe()

    def _reset(self) -> None:
        log.warning(
            "stream %s was recreated (the broker lost its store): replaying %s from the "
            "start, what came before #%d is forgotten",
            self.stream.name,
            self.subject_filter,
            self.last_sequence,
        )
        self.last_sequence = 0
        self.resets += 1
        if self.on_reset is not None:
            try:
                self.on_reset()
            except Exception:
                log.exception("reset handler of %s failed", self.subject_filter)

    async def _on_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.last_sequence:
            return  # already delivered before a resubscribe
        self.last_sequence = seq
        try:
            await self.handler(msg.subject, msg.data, seq)
        except Exception:
            log.exception("event handler failed on %s #%d", msg.subject, seq)

    async def close(self) -> None:
        self._closed = True
        self.runtime.remove_reconnect_listener(self._resubscribe)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None


def _start_at(sequence: int) -> ConsumerConfig:
    return ConsumerConfig(
        opt_start_seq=max(1, sequence), deliver_policy=DeliverPolicy.BY_START_SEQUENCE
    )
