"""The serving side of an endpoint: receive requests, run the handler, stream frames back.

A handler is an async generator `handler(request, context)` yielding response items. Each
request runs in its own task, split in two so a fast handler does not pay one NATS message
per item:

* the *producer* iterates the handler and appends each encoded item to an outbox;
* the *sender* wakes when the outbox has items and publishes everything queued as one
  frame (DATA for one item, BATCH for several), so an engine that yields one output per
  step sends one frame per step, while a burst is coalesced.

The outbox is bounded (`_HIGH_WATER_BYTES`): a handler that outruns the connection waits.

Cancellation: a control message names the stream's reply subject; the request's
`Context` turns stopped and the producer task is cancelled, which closes the handler's
generator (its `finally` blocks run, e.g. to abort the request in the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dynamo.runtime import wire
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Handler = Callable[[Any, "Context"], AsyncIterator[Any]]

_HIGH_WATER_BYTES = 256 * 1024


class Context:
    """Per-request context handed to a handler."""

    __slots__ = ("_stopped", "id", "instance_id")

    def __init__(self, request_id: str, instance_id: int) -> None:
        self.id = request_id
        self.instance_id = instance_id
        self._stopped = asyncio.Event()

    def is_stopped(self) -> bool:
        """True once the client cancelled (or the server is shutting down)."""
        return self._stopped.is_set()

    async def stopped(self) -> None:
        """Wait until the request is stopped."""
        await self._stopped.wait()

    def stop_generating(self) -> None:
        self._stopped.set()


class _Outbox:
    """Encoded items waiting to be sent, plus the terminal state of the producer."""

    __slots__ = ("error", "finished", "items", "nbytes", "ready", "space")

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.nbytes = 0
        self.ready = asyncio.Event()
        self.space = asyncio.Event()
        self.space.set()
        self.finished = False
        self.error: BaseException | None = None

    def push(self, item: bytes) -> None:
        self.items.append(item)
        self.nbytes += len(item)
        self.ready.set()
        if self.nbytes >= _HIGH_WATER_BYTES:
            self.space.clear()

    def take(self) -> list[bytes]:
        items, self.items, self.nbytes = self.items, [], 0
        self.ready.clear()
        self.space.set()
        return items

    def close(self, error: BaseException | None = None) -> None:
        self.finished = True
        self.error = error
        self.ready.set()


class InflightRequest:
    """One request being served: its context and the task running its handler."""

    __slots__ = ("context", "producer")

    def __init__(self, context: Context) -> None:
        self.context = context
        self.producer: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self.context.stop_generating()
        if self.producer is not None and not self.producer.done():
            self.producer.cancel()


class InflightRegistry:
    """The requests a process is serving, by reply subject.

    One per runtime, shared by all its endpoints, because cancellations arrive on one
    control subject per process and name the stream by its reply subject only.
    """

    def __init__(self) -> None:
        self._requests: dict[str, InflightRequest] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, reply: str, request: InflightRequest) -> None:
        self._requests[reply] = request

    def remove(self, reply: str) -> None:
        self._requests.pop(reply, None)

    def dispatch_control(self, data: bytes) -> bool:
        """Apply one control message; True if it named a request being served here."""
        try:
            reply, action = wire.decode_control(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("malformed control message dropped")
            return False
        request = self._requests.get(reply)
        if request is None:
            return False
        if action is wire.ControlAction.STOP:
            request.cancel()
        return True


class EndpointServer:
    """Serves one endpoint of one process on its instance subject."""

    def __init__(
        self,
        nc: NatsClient,
        subject: str,
        instance_id: int,
        handler: Handler,
        request_type: Any = None,
        registry: InflightRegistry | None = None,
    ) -> None:
        self._nc = nc
        self.subject = subject
        self.instance_id = instance_id
        self._handler = handler
        self._decoder = wire.decoder_for(request_type)
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._registry = registry if registry is not None else InflightRegistry()
        self.requests_served = 0

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self.subject, cb=self._on_request)

    async def stop_accepting(self) -> None:
        """Unsubscribe: requests still in flight continue, new ones see no responder."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` for in-flight requests, then cancel the rest.

        Returns how many were cancelled."""
        await self.stop_accepting()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        leftover = list(self._tasks)
        await asyncio.gather(*(cancel_and_wait(task) for task in leftover))
        return len(leftover)

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("request on %s without a reply subject dropped", self.subject)
            return
        task = asyncio.create_task(self._serve(msg.reply, msg.data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reply: str, data: bytes) -> None:
        self.requests_served += 1
        seq = 0
        try:
            request_id, raw = wire.decode_request(data)
            request = self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._nc.publish(
                reply, wire.encode_error(seq, "BadRequest", f"undecodable request: {exc}")
            )
            return
        inflight = InflightRequest(Context(request_id, self.instance_id))
        self._registry.add(reply, inflight)
        outbox = _Outbox()
        inflight.producer = asyncio.create_task(self._produce(request, inflight.context, outbox))
        try:
            while True:
                await outbox.ready.wait()
                items = outbox.take()
                for frame in wire.pack_frames(seq, items):
                    await self._nc.publish(reply, frame)
                    seq += 1
                if outbox.finished and not outbox.items:
                    break
            if inflight.context.is_stopped():
                return  # the client is gone; nobody reads a terminal frame
            if outbox.error is None:
                await self._nc.publish(reply, wire.encode_end(seq))
            else:
                error = outbox.error
                await self._nc.publish(
                    reply, wire.encode_error(seq, type(error).__name__, str(error))
                )
        except asyncio.CancelledError:
            inflight.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await inflight.producer
            with contextlib.suppress(Exception):
                await self._nc.publish(
                    reply,
                    wire.encode_error(
                        seq, wire.SHUTDOWN_ERROR_TYPE, "it shut down before the request finished"
                    ),
                )
            raise
        finally:
            self._registry.remove(reply)

    async def _produce(self, request: Any, context: Context, outbox: _Outbox) -> None:
        agen = self._handler(request, context)
        encode = wire.encode
        try:
            async for item in agen:
                outbox.push(encode(item))
                if not outbox.space.is_set():
                    await outbox.space.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await agen.aclose()
            outbox.close()
            raise
        except Exception as exc:
            log.debug("handler on %s raised %r", self.subject, exc)
            outbox.close(exc)
            return
        outbox.close()
