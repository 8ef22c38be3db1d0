"""Events: replayable JetStream streams and fire-and-forget core subjects.

* `EventStream` — a JetStream stream for events that a late subscriber must be able to
  replay (KV-cache events: a frontend that starts after the workers rebuilds its index
  from the stream). Bounded by age and size so it cannot grow without limit.
* `StreamSubscription` — an ordered push consumer from the start of the stream (or a given
  sequence), recreated after a broker reconnect from the last sequence it delivered, so
  nothing is applied twice and nothing is skipped while the stream still holds it.
* Core subjects (`DistributedRuntime.publish/subscribe`) carry periodic snapshots such as
  load metrics, where only the latest value matters.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from dynamo.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

EventHandler = Callable[[str, bytes, int], Awaitable[None]]
"""handler(subject, payload, stream_sequence)"""


@dataclass(frozen=True)
class EventStream:
    """A JetStream stream capturing `subjects` (wildcards allowed)."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float = 3600.0
    max_bytes: int = 256 * 1024 * 1024

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            storage=StorageType.FILE,
        )

    async def ensure(self, runtime: DistributedRuntime) -> None:
        """Create the stream if it does not exist (idempotent)."""
        try:
            await runtime.js.stream_info(self.name)
        except NotFoundError:
            try:
                await runtime.js.add_stream(self.config())
            except BadRequestError:
                await runtime.js.stream_info(self.name)  # created concurrently

    async def publish(self, runtime: DistributedRuntime, subject: str, payload: bytes) -> int:
        """Publish and wait for the stream's ack; returns the stream sequence."""
        ack = await runtime.js.publish(subject, payload, stream=self.name)
        return ack.seq

    async def purge_subject(self, runtime: DistributedRuntime, subject: str) -> None:
        """Drop every stored event of `subject` (e.g. a worker whose cache was reset)."""
        await runtime.js.purge_stream(self.name, subject=subject)


class StreamSubscription:
    """Delivers every event of `subject_filter` in `stream` to `handler`, in order."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        stream: EventStream,
        subject_filter: str,
        handler: EventHandler,
        *,
        start_sequence: int = 1,
    ) -> None:
        self._runtime = runtime
        self._stream = stream
        self._filter = subject_filter
        self._handler = handler
        self.last_sequence = start_sequence - 1
        self._sub = None
        self._closed = False

    async def start(self) -> StreamSubscription:
        await self._stream.ensure(self._runtime)
        await self._subscribe()
        self._runtime.add_reconnect_listener(self._resubscribe)
        return self

    async def _subscribe(self) -> None:
        self._sub = await self._runtime.js.subscribe(
            self._filter,
            stream=self._stream.name,
            cb=self._on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            config=_start_at(self.last_sequence + 1),
        )

    async def _resubscribe(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()
        try:
            await self._stream.ensure(self._runtime)
            await self._subscribe()
        except Exception as exc:
            log.warning("resubscribing to %s failed: %s", self._filter, exc)

    async def _on_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.last_sequence:
            return  # already delivered before a resubscribe
        self.last_sequence = seq
        try:
            await self._handler(msg.subject, msg.data, seq)
        except Exception:
            log.exception("event handler failed on %s #%d", msg.subject, seq)

    async def close(self) -> None:
        self._closed = True
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None


def _start_at(sequence: int) -> ConsumerConfig:
    return ConsumerConfig(
        opt_start_seq=max(1, sequence), deliver_policy=DeliverPolicy.BY_START_SEQUENCE
    )
