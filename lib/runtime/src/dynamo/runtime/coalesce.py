"""Response frames that are ready together travel together: one NATS message per inbox
per event-loop turn.

An engine step produces one output for each of its running requests at the same moment.
Sent one by one, each costs a publish here, a routed message in nats-server, and a parsed
message and a callback in the process that reads it: per request, per step. But every
stream a process opens replies to that process's own inbox (`<prefix><token>`), so the
frames of many streams bound for one process can share a message. `ReplyCoalescer`
collects the frames queued during one turn of the event loop, groups them by inbox, and
publishes each group as one MUX message on `<prefix>mux` (`wire.encode_mux`), where the
inbox's wildcard subscription receives it and hands each frame to its stream in order. A
group of one frame is published to its reply subject as it is, so a lone stream (c=1)
pays nothing for this.

* Order: the frames of one reply subject go out in the order they were queued (they all
  share one group, and groups go out in turn order).
* Size: a group is split so that no message exceeds the server's max payload; a frame
  that alone exceeds it goes alone and fails alone.
* Failures: a publish that fails (connection closed, outbound buffer full during an
  outage, payload over the limit) is reported to the `FrameSink` of every frame it
  carried, so each stream fails as if its own publish had.
* Replies outside the runtimes' inboxes (a plain NATS request) are published one by one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from nats.aio.client import Client as NatsClient

from dynamo.runtime import naming, wire

log = logging.getLogger(__name__)

HIGH_WATER_BYTES = 1024 * 1024
"""Queued bytes above which senders wait (`wait_for_space`) until a publish completes:
the bound on what piles up while a publish is held up by a full outbound buffer."""


class FrameSink(Protocol):
    """Told when a frame it queued could not be published."""

    def frame_failed(self, error: BaseException, frame: bytes) -> None: ...


Queued = tuple[str, bytes, "FrameSink | None"]
"""(reply subject, frame, who hears if it fails)."""

DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""nats-server's default, for a connection that has not reported its own yet."""


class ReplyCoalescer:
    """Publishes queued response frames once per event-loop turn, grouped by inbox."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._queued: list[Queued] = []
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.messages_published = 0
        self.frames_published = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="reply-coalescer")

    def send(self, reply: str, frame: bytes, sink: FrameSink | None = None) -> None:
        """Queue `frame` for `reply`; it goes out in the next turn of the event loop."""
        self._queued.append((reply, frame, sink))
        self._queued_bytes += len(frame)
        if self._queued_bytes >= HIGH_WATER_BYTES:
            self._space.clear()
        self._wake.set()

    async def wait_for_space(self) -> None:
        """Return once the queue is below its high-water mark."""
        if not self._space.is_set():
            await self._space.wait()

    async def close(self) -> None:
        """Publish what is queued, then stop (a publish under way is finished, not cut)."""
        self._closing = True
        self._wake.set()
        task, self._task = self._task, None
        if task is not None:
            await task
        await self._publish_queued()

    async def _run(self) -> None:
        while not self._closing:
            await self._wake.wait()
            await self._publish_queued()

    async def _publish_queued(self) -> None:
        self._wake.clear()
        queued, self._queued, self._queued_bytes = self._queued, [], 0
        self._space.set()
        if not queued:
            return
        for subject, payload, entries in self._messages(queued):
            try:
                await self._nc.publish(subject, payload)
            except Exception as exc:
                _report_failure(entries, exc)
                continue
            self.messages_published += 1
            self.frames_published += len(entries)

    def _messages(self, queued: list[Queued]) -> list[Message]:
        """The messages to publish, in queue order per inbox: other replies one by one,
        each inbox's frames packed under the server's max payload."""
        groups: dict[str, list[Queued]] = {}
        messages: list[Message] = []
        for entry in queued:
            prefix = naming.inbox_of(entry[0])
            if prefix is None:
                messages.append((entry[0], entry[1], [entry]))
            else:
                groups.setdefault(prefix, []).append(entry)
        limit = self._nc.max_payload or DEFAULT_MAX_PAYLOAD
        for prefix, entries in groups.items():
            messages.extend(pack_messages(prefix, entries, limit))
        return messages


Message = tuple[str, bytes, list[Queued]]
"""(subject, payload, the queued frames it carries)."""


def _report_failure(entries: list[Queued], error: BaseException) -> None:
    for reply, frame, sink in entries:
        if sink is None:
            log.debug("frame to %s not sent: %s: %s", reply, type(error).__name__, error)
        else:
            sink.frame_failed(error, frame)


def pack_messages(prefix: str, entries: list[Queued], limit: int) -> list[Message]:
    """MUX messages for one inbox, each under `limit` bytes; a message of one frame goes
    to that frame's reply subject unwrapped."""
    messages: list[Message] = []
    chunk: list[Queued] = []
    size = 0
    for entry in entries:
        cost = len(entry[1]) + len(entry[0]) - len(prefix) + wire.MUX_OVERHEAD_BYTES
        if chunk and size + cost > limit:
            messages.append(_message(prefix, chunk))
            chunk, size = [], 0
        chunk.append(entry)
        size += cost
    if chunk:
        messages.append(_message(prefix, chunk))
    return messages


def _message(prefix: str, chunk: list[Queued]) -> Message:
    if len(chunk) == 1:
        return chunk[0][0], chunk[0][1], chunk
    start = len(prefix)
    payload = wire.encode_mux([(reply[start:], frame) for reply, frame, _ in chunk])
    return prefix + naming.MUX_TOKEN, payload, chunk
