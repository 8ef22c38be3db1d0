"""The process's response inbox: one wildcard subscription, demultiplexed by reply subject.

Every response stream of a process arrives on `<inbox prefix>.<token>`, one token per
stream. A single subscription on `<prefix>.*` receives them all (nats-py's own
request/reply does the same), and `Inbox` is the only owner of the token -> receiver
table: a stream asks for a reply subject with `open(receiver)` and gives it back with
`close(reply)`; nobody else reads or writes the table.

A worker sends the frames of several of our streams that were ready together as one MUX
message on `<prefix>mux` (`dynamo.runtime.coalesce`); the inbox unpacks it and hands each
frame to its stream, in order, exactly as if it had arrived alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header

from dynamo.runtime import naming, wire
from dynamo.runtime.errors import RuntimeClosedError

log = logging.getLogger(__name__)

Receiver = Callable[[bytes | None], None]
"""Called (on the event loop, in arrival order) with each frame of one stream; None when
NATS answered the request with "no responders" instead."""


class Inbox:
    """Routes messages arriving on this process's inbox to the stream they belong to."""

    def __init__(self, token: str) -> None:
        self.prefix = naming.inbox_prefix(token)
        self._receivers: dict[str, Receiver] = {}
        self._counter = 0
        self._subscription: Subscription | None = None
        self._closed = False

    async def start(self, nc: NatsClient) -> None:
        """Subscribe to the whole inbox (nats-py restores it after a reconnect)."""
        self._subscription = await nc.subscribe(self.prefix + "*", cb=self._on_message)

    def open(self, receiver: Receiver) -> str:
        """A fresh reply subject whose messages go to `receiver` until `close`.
        Raises `RuntimeClosedError` once the runtime shut down."""
        if self._closed:
            raise RuntimeClosedError("the runtime is shut down")
        self._counter += 1
        token = format(self._counter, "x")
        self._receivers[token] = receiver
        return self.prefix + token

    def close(self, reply: str) -> None:
        """Stop delivering `reply`'s messages (late ones are dropped). Idempotent."""
        self._receivers.pop(reply[len(self.prefix) :], None)

    def close_all(self) -> None:
        """The runtime is shutting down: forget every stream and refuse new ones."""
        self._closed = True
        self._receivers.clear()

    @property
    def open_streams(self) -> int:
        return len(self._receivers)

    async def _on_message(self, msg: Msg) -> None:
        token = msg.subject[len(self.prefix) :]
        if token == naming.MUX_TOKEN:
            self._unpack(msg.data)
            return
        receiver = self._receivers.get(token)
        if receiver is None:
            log.debug("message on closed inbox subject %s dropped", msg.subject)
            return
        headers = msg.headers
        if headers and headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            receiver(None)
        else:
            receiver(msg.data)

    def _unpack(self, data: bytes) -> None:
        try:
            frames = wire.decode_mux(data)
        except Exception as exc:
            log.warning("malformed MUX message on %s dropped: %s", self.prefix, exc)
            return
        receivers = self._receivers
        for token, frame in frames:
            receiver = receivers.get(token)
            if receiver is None:
                log.debug("frame for closed inbox subject %s%s dropped", self.prefix, token)
                continue
            receiver(bytes(frame))
