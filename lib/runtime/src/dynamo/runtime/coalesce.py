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
* Lost ENDs: a frame written just before the connection dropped may never reach the
  server. A lost DATA frame shows at the reader as a skip in the frame numbers with the
  next frame; a lost END has no next frame, so the coalescer remembers the streams that
  ended lately (`RECENT_END_WINDOW_S`) and, after a reconnect, sends each one more END
  numbered after its own (`probe_recent_ends`). A reader that got the END has closed
  that inbox subject and never sees it; one that lost it sees the skip.

A response stream does not send frames itself: its items wait in a `ReplyStream`, which
the flush packs into frames (DATA for one item, BATCH for several) just before it
publishes. So the handler's task appends an item and goes on; no task per stream wakes
per item to forward it, and an engine step's outputs still leave in one message.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
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


STREAM_HIGH_WATER_BYTES = 256 * 1024
"""Items one stream may have waiting before its producer waits (`ReplyStream.space`)."""

TerminalFrame = Callable[[int], bytes]
"""The frame that ends a stream, given the sequence number it takes."""

RECENT_END_WINDOW_S = 10.0
"""How long a stream is remembered after its END went out: frames a dropped connection
loses were written shortly before the drop was noticed, which takes up to the runtime's
ping interval times its outstanding pings (4 to 6 s) when a link is cut silently."""


class ReplyStream:
    """One response stream's items between its producer and the coalescer's next flush.

    `push` appends an encoded item; the flush takes the items, numbers them and packs
    them into frames (`wire.pack_frames`), then the terminal frame once `finish` gave
    one. A frame that could not be published is recorded (`error`, with the number and
    size of the first such frame: the client has everything before it), what is still
    waiting is dropped, and `on_failure` is called.
    """

    __slots__ = (
        "_accepted",
        "_coalescer",
        "_items",
        "_nbytes",
        "_scheduled",
        "_terminal",
        "ended",
        "error",
        "failed_seq",
        "failed_size",
        "items_pushed",
        "on_failure",
        "reply",
        "seq",
        "space",
    )

    def __init__(
        self,
        coalescer: ReplyCoalescer,
        reply: str,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self._coalescer = coalescer
        self.reply = reply
        self.on_failure = on_failure
        self.seq = 0
        self._accepted = False  # an ACCEPTED frame waits for the next flush
        self.items_pushed = 0  # every item the producer pushed, sent or waiting
        self._items: list[bytes] = []
        self._nbytes = 0
        self._scheduled = False
        self._terminal: TerminalFrame | None = None
        self.ended = False
        self.space = asyncio.Event()
        self.space.set()
        self.error: BaseException | None = None
        self.failed_seq = 0
        self.failed_size = 0

    def push(self, item: bytes) -> None:
        """Queue an encoded item for the next flush (dropped once a frame failed)."""
        if self.error is not None:
            return
        self.items_pushed += 1
        self._items.append(item)
        self._nbytes += len(item)
        if self._nbytes >= STREAM_HIGH_WATER_BYTES:
            self.space.clear()
        self._schedule()

    def accept(self) -> None:
        """Tell the client, at the next flush, that the request reached its handler
        (frame 0): a client that hears nothing in time knows the request was lost on its
        way, not merely slow to produce."""
        self._accepted = True
        self._schedule()

    def finish(self, terminal: TerminalFrame) -> None:
        """End the stream after the items pushed so far with `terminal(seq)`."""
        self._terminal = terminal
        self._schedule()

    def schedule(self, stream: ReplyStream) -> None:
        """Take `stream`'s waiting items (and terminal frame) at the next flush."""
        self._streams.append(stream)
        self._wake.set()

    async def wait_for_space(self) -> None:
        """Return once neither this stream nor the coalescer is over its high-water mark."""
        if not self.space.is_set():
            await self.space.wait()
        await self._coalescer.wait_for_space()

    def take_frames(self) -> list[bytes]:
        """The frames of everything waiting, numbered on from `seq`."""
        self._scheduled = False
        items, self._items, self._nbytes = self._items, [], 0
        self.space.set()
        frames: list[bytes] = []
        if self._accepted:
            self._accepted = False
            frames.append(wire.encode_accepted(self.seq))
            self.seq += 1
        if items:
            packed = wire.pack_frames(self.seq, items)
            frames.extend(packed)
            self.seq += len(packed)
        if self._terminal is not None:
            frames.append(self._terminal(self.seq))
            self._terminal = None
            self.seq += 1
            self.ended = True
        return frames

    def frame_failed(self, error: BaseException, frame: bytes) -> None:
        """`FrameSink`: the coalescer could not publish `frame`."""
        if self.error is not None:
            return  # the frames after the first failed one are lost with it
        self.error = error
        self.failed_seq = wire.decode_frame(frame)[0]
        self.failed_size = len(frame)
        self._items, self._nbytes, self._terminal = [], 0, None
        self.space.set()
        if self.on_failure is not None:
            self.on_failure()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._coalescer.schedule(self)


class ReplyCoalescer:
    """Publishes queued response frames once per event-loop turn, grouped by inbox."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._streams: list[ReplyStream] = []
        self._queued: list[Queued] = []
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._recent_ends: collections.deque[tuple[float, str, int]] = collections.deque()
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

    def schedule(self, stream: ReplyStream) -> None:
        """Take `stream`'s waiting items (and terminal frame) at the next flush."""
        self._streams.append(stream)
        self._wake.set()

    def probe_recent_ends(self) -> int:
        """After a reconnect: send one more END, numbered after the real one, to each
        stream that ended within `RECENT_END_WINDOW_S` (see the module docstring).
        Returns how many were sent."""
        self._forget_old_ends(time.monotonic())
        for _, reply, seq in self._recent_ends:
            self.send(reply, wire.encode_end(seq))
        return len(self._recent_ends)

    def _forget_old_ends(self, now: float) -> None:
        ends = self._recent_ends
        while ends and now - ends[0][0] > RECENT_END_WINDOW_S:
            ends.popleft()

    def has_space(self) -> bool:
        """The queue is below its high-water mark."""
        return self._space.is_set()

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
        streams, self._streams = self._streams, []
        queued: list[Queued] = []
        now = time.monotonic()
        for stream in streams:  # before the frames sent directly, which end streams
            had_ended = stream.ended
            queued.extend((stream.reply, frame, stream) for frame in stream.take_frames())
            if stream.ended and not had_ended:
                self._recent_ends.append((now, stream.reply, stream.seq))
        if streams:
            self._forget_old_ends(now)
        queued.extend(self._queued)
        self._queued, self._queued_bytes = [], 0
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
