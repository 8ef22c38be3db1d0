"""The serving side of an endpoint: receive requests, run the handler, stream frames back.

A handler is an async generator `handler(request, context)` yielding response items. Each
request runs in its own task, the *producer*, which iterates the handler and appends each
encoded item to the request's `ReplyStream`; the request's own task only waits for the
producer to finish and then ends the stream (END, or an error frame).

Items are not sent one by one: the endpoint's `ReplyCoalescer` takes every stream's
waiting items once per event-loop turn, packs each stream's into frames (DATA for one
item, BATCH for several, so a burst is coalesced) and publishes the frames bound for one
process's inbox as one NATS message: an engine step that advances many streams read by
one frontend costs one message, and no task wakes per item to forward it.

A stream's waiting items are bounded (`coalesce.STREAM_HIGH_WATER_BYTES`), and so is the
coalescer's queue: a handler that outruns the connection waits.

Cancellation: a control message names the stream's reply subject; the request's
`Context` turns stopped and the producer task is cancelled, which closes the handler's
generator (its `finally` blocks run, e.g. to abort the request in the engine).

Bounds and failures, so that no request is left running for a client that will never
hear from it, and no burst can make a worker create tasks without limit:

* `max_inflight`: an endpoint serving that many requests refuses the next one at once
  with an `OVERLOADED` error frame (no task is created), which the caller takes as "send
  it elsewhere";
* a frame that cannot be published (larger than the server's max payload, the outbound
  buffer full while NATS is unreachable, a closed connection) cancels the producer (the
  engine aborts the request) and ends the stream with an error frame if one can still be
  sent;
* a handler raising a `RequestRefusedError` ends the stream with an error frame of that
  kind (e.g. `INVALID_REQUEST`: the client's fault, HTTP 400 at the frontend).
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
from dynamo.runtime.coalesce import ReplyCoalescer, ReplyStream
from dynamo.runtime.errors import RequestRefusedError
from dynamo.runtime.request_parts import JoinerFullError, PartError, RequestJoiner, part_of
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Handler = Callable[[Any, "Context"], AsyncIterator[Any]]

PUBLISH_FLUSH_TIMEOUT_S = 2.0
"""How long a publish may wait for nats-py to flush a full outbound buffer (the runtime
connects with it as nats-py's `flush_timeout`). Without it, a publish that forced a flush
just as the connection dropped waits until NATS is back, holding its request (and the
engine's work on it) however long the outage lasts; with it the publish returns, and the
next one fails with `OutboundBufferLimitError`, which cancels the request."""


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
        *,
        max_inflight: int | None = None,
    ) -> None:
        """`max_inflight`: the most requests served at once (None or 0: no bound)."""
        if max_inflight is not None and max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0, got {max_inflight}")
        self._nc = nc
        self.coalescer = ReplyCoalescer(nc)
        self.subject = subject
        self.instance_id = instance_id
        self._handler = handler
        self._decoder = wire.decoder_for(request_type)
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._registry = registry if registry is not None else InflightRegistry()
        self.max_inflight = max_inflight or None
        self.requests_served = 0
        self.requests_refused = 0  # refused because `max_inflight` were in flight
        self._refusing = False  # refused one since the last time there was room
        self.joiner = RequestJoiner()  # requests that came in parts (request_parts)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def is_full(self) -> bool:
        """True while `max_inflight` requests are in flight (new ones are refused)."""
        return self.max_inflight is not None and len(self._tasks) >= self.max_inflight

    async def start(self) -> None:
        self.coalescer.start()
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
        await self.coalescer.close()  # the last frames (ENDs, shutdown errors) go out
        return len(leftover)

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("request on %s without a reply subject dropped", self.subject)
            return
        data = self._whole_request(msg)
        if data is None:
            return
        if self.is_full():
            self._refuse(msg.reply)
            return
        task = asyncio.create_task(self._serve(msg.reply, data))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _whole_request(self, msg: Msg) -> bytes | None:
        """The request `msg` carries, or completes when it is the last of its parts; None
        while parts are missing, or when a part was refused (the client is told why)."""
        try:
            part = part_of(msg.headers)
            if part is None:
                return msg.data
            return self.joiner.add(msg.reply, *part, msg.data)
        except PartError as exc:
            log.warning("request parts on %s dropped: %s", self.subject, exc)
            if isinstance(exc, JoinerFullError):  # another instance may take it
                frame = wire.encode_kind_error(0, wire.ErrorKind.OVERLOADED, str(exc))
            else:
                frame = wire.encode_error(0, "BadRequest", str(exc))
            self._send_quietly(msg.reply, frame)
            return None

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._refusing and not self.is_full():
            self._refusing = False
            log.info(
                "%s: below %d requests in flight, accepting again", self.subject, self.max_inflight
            )

    def _refuse(self, reply: str) -> None:
        """Answer at once, without a task: the caller places the request elsewhere."""
        self.requests_refused += 1
        if not self._refusing:  # once per episode, not once per request
            self._refusing = True
            log.warning(
                "%s: %d requests in flight, its bound; refusing new ones",
                self.subject,
                self.max_inflight,
            )
        message = f"the worker is serving its limit of {self.max_inflight} requests"
        self._send_quietly(reply, wire.encode_kind_error(0, wire.ErrorKind.OVERLOADED, message))

    def _send_quietly(self, reply: str, frame: bytes) -> None:
        """Queue a last frame; if it cannot be published, that is logged at debug (the
        client's own deadline ends its wait)."""
        self.coalescer.send(reply, frame)

    async def _serve(self, reply: str, data: bytes) -> None:
        self.requests_served += 1
        try:
            request_id, raw = wire.decode_request(data)
            request = self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._send_quietly(
                reply, wire.encode_error(0, "BadRequest", f"undecodable request: {exc}")
            )
            return
        inflight = InflightRequest(Context(request_id, self.instance_id))
        self._registry.add(reply, inflight)
        settled = asyncio.Event()  # the handler is done, or a frame could not be sent
        stream = ReplyStream(self.coalescer, reply, on_failure=settled.set)
        stream.accept()
        producer = asyncio.create_task(self._produce(request, inflight.context, stream, settled))
        inflight.producer = producer
        try:
            await settled.wait()
            if stream.error is not None:
                raise stream.error
            if inflight.context.is_stopped():
                return  # the client is gone (its producer was cancelled): no terminal frame
            error = await producer
            stream.finish(
                wire.encode_end
                if error is None
                else _terminal_error(error, stream.items_pushed > 0)
            )
        except asyncio.CancelledError:
            inflight.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
            message = "it shut down before the request finished"
            stream.finish(lambda seq: wire.encode_kind_error(seq, wire.ErrorKind.SHUTDOWN, message))
            raise
        except Exception as exc:  # a frame could not be published
            await self._abandon(inflight, stream, exc)
        finally:
            self._registry.remove(reply)

    async def _abandon(
        self, inflight: InflightRequest, stream: ReplyStream, exc: Exception
    ) -> None:
        """A frame could not be sent: stop the producer (its handler's `finally` aborts
        the request in the engine) and tell the client, if a small frame still gets out
        (during an outage it does not: the client's own deadline ends its wait)."""
        what = f"{stream.failed_size} bytes: {_describe(exc)}"
        log.warning(
            "request %s on %s: response frame %d not sent (%s); cancelling the request",
            inflight.context.id,
            self.subject,
            stream.failed_seq,
            what,
        )
        inflight.cancel()
        await cancel_and_wait(inflight.producer)
        message = f"the worker could not send its response ({what})"
        self._send_quietly(
            stream.reply, wire.encode_error(stream.failed_seq, type(exc).__name__, message)
        )

    async def _produce(
        self, request: Any, context: Context, stream: ReplyStream, settled: asyncio.Event
    ) -> BaseException | None:
        """Push the handler's items on `stream`; returns the exception the handler raised
        (None when it finished), which becomes the stream's terminal frame."""
        agen = self._handler(request, context)
        encode = wire.encode
        push = stream.push
        try:
            async for item in agen:
                push(encode(item))
                if not stream.space.is_set() or not self.coalescer.has_space():
                    await stream.wait_for_space()
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await agen.aclose()
            raise
        except Exception as exc:
            log.debug("handler on %s raised %r", self.subject, exc)
            return exc
        finally:
            settled.set()
        return None


def _terminal_error(error: BaseException, produced: bool) -> Callable[[int], bytes]:
    return lambda seq: _error_frame(seq, error, produced)


def _error_frame(seq: int, error: BaseException, produced: bool) -> bytes:
    """The terminal frame of a handler that raised: a refusal keeps its kind, except an
    `OVERLOADED` one after outputs were `produced` (the caller must not send it elsewhere
    and repeat them); anything else is reported under its class name."""
    if isinstance(error, RequestRefusedError) and (
        not produced or error.kind is not wire.ErrorKind.OVERLOADED
    ):
        return wire.encode_kind_error(seq, error.kind, str(error))
    return wire.encode_error(seq, type(error).__name__, str(error))


def _describe(exc: BaseException) -> str:
    """`Type: text` of an exception, or just its type when it has no text."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
