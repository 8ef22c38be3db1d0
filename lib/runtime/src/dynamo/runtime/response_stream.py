"""`ResponseStream`: one request sent to one instance, and the frames that answer it.

Separate from `client.py`, which chooses the instance (`Client` watches the endpoint's
instances and opens the streams): a stream only sends its request, reads the frames its
instance writes back through the process's `Inbox`, enforces its deadlines, and ends with
a typed error saying why it failed.

A stream talks to exactly one instance and never retries: where a request should go
next when its instance fails is a placement decision, made by the caller (the LLM
layer's engine client re-places or migrates through its router). The stream only reports
*why* it failed, with typed errors:

* `NoResponderError` (an `InstanceGoneError`) when the instance had no subscriber (NATS
  answers "no responders" at once; nothing was processed, so sending elsewhere, or to it
  again later, is safe; the instance is left out of `Client.routable_ids()` for a pause
  of `SUSPECT_FIRST_S` to `SUSPECT_MAX_S` (`client.py`), and `Client.wait_routable()`
  waits for the first pause to end);
* `InstanceGoneError` when the instance's key leaves the bucket
  before the END frame (a SIGKILLed worker is detected within the lease window instead of
  hanging the caller), when it shut down before finishing, or when it was no longer
  registered by the time the stream started (nothing sent);
* `NoInstancesError` when there is nobody to send to;
* `RequestNotAcceptedError` (a `StreamTimeoutError`) when the instance does not confirm
  the request (its ACCEPTED frame, sent as the request reaches the handler) within
  `accept_timeout`: the request was lost on its way (a NATS node failing while it was
  routed) or the instance is frozen; a STOP is sent in case it did get there, and the
  instance is paused as after a "no responders";
* `StreamTimeoutError` when the instance stays silent longer than the stream's deadline
  (`first_item_timeout` before the first item, `item_timeout` between items): it holds its
  lease but stopped answering this request (a STOP is sent, so it stops working on it);
* `ConnectionLostError` (an `InstanceGoneError`) when this process's own NATS connection
  dropped while the stream was open: on a cluster the client reconnects to another node
  at once, but what was published to its inbox in between is lost;
* `FramesLostError` (a `ConnectionLostError`) when the frame numbers skip: the instance's
  connection dropped and took frames it had written;
* `ClientClosedError` when the `Client` is closed while the stream is open: a closed
  client no longer watches the instances, so it could not report the instance's loss and
  the stream would wait forever.

Closing a stream early (`aclose()`, `async with`, or breaking out and closing) sends a
STOP on the instance's control subject, which cancels the handler; so does closing a
stream that failed on this side (deadline, closed client, malformed frame) while the
instance may still be working on it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from typing import Any, Generic, Protocol, TypeVar

from nats.aio.client import Client as NatsClient

from dynamo.runtime import naming, request_parts, wire
from dynamo.runtime.errors import (
    ClientClosedError,
    FramesLostError,
    InstanceGoneError,
    NoResponderError,
    RequestNotAcceptedError,
    RequestTooLargeError,
    StreamProtocolError,
    StreamTimeoutError,
    error_from_frame,
)
from dynamo.runtime.inbox import Inbox
from dynamo.runtime.request_parts import MAX_CARRIED_REQUEST_BYTES

log = logging.getLogger(__name__)

T = TypeVar("T")


class StreamTransport(Protocol):
    """What a stream uses of this process's runtime: the NATS connection it publishes its
    request and its STOP on, and the shared inbox its frames arrive through."""

    nc: NatsClient
    inbox: Inbox


class StreamEndpoint(Protocol):
    """The endpoint a stream's request goes to (only its path, for error messages)."""

    @property
    def path(self) -> str: ...


class StreamOwner(Protocol):
    """What a stream needs of the `Client` that opened it (`client.Client`): the runtime
    it sends on, whether the instance is still registered and where it takes requests,
    the tracking through which the instance's loss fails the stream, and word of whether
    the instance answered. A protocol, so that this module does not import the client
    that opens its streams."""

    @property
    def runtime(self) -> StreamTransport: ...

    @property
    def endpoint(self) -> StreamEndpoint: ...

    @property
    def closed(self) -> bool: ...

    def knows(self, instance_id: int) -> bool: ...

    def request_subject(self, instance_id: int) -> str: ...

    def track(self, stream: ResponseStream[Any], instance_id: int) -> None: ...

    def untrack(self, stream: ResponseStream[Any], instance_id: int) -> None: ...

    def mark_unreachable(self, instance_id: int) -> None: ...

    def mark_reachable(self, instance_id: int) -> None: ...


class ResponseStream(Generic[T]):
    """Async iterator over one request's responses from one instance. Nothing is sent
    until the first `__anext__`; `aclose()` before the end cancels the request there.

    The deadlines are inactivity limits, counted from when the reader starts waiting: a
    reader that is slow itself never makes the instance look silent."""

    def __init__(
        self,
        client: StreamOwner,
        request: object,
        instance_id: int,
        *,
        response_type: type[T] | None = None,
        request_id: str | None = None,
        first_item_timeout: float | None = None,
        item_timeout: float | None = None,
        accept_timeout: float | None = None,
    ) -> None:
        self._client = client
        self.instance_id = instance_id
        self.request_id = request_id or uuid.uuid4().hex
        self._payload = wire.encode_request(self.request_id, request)
        self._decoder = wire.decoder_for(response_type)
        self._batch_decoder = wire.batch_decoder_for(response_type)
        self._first_item_timeout = first_item_timeout
        self._item_timeout = item_timeout
        self._accept_timeout = accept_timeout
        self._received_item = False
        self._ended_remotely = False  # END / ERROR frame or no responder: nothing to cancel
        self._cancel_sent = False
        self._reply: str | None = None
        self._frames: collections.deque[bytes | None] = collections.deque()  # None: no responder
        self._items: collections.deque[T] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._seq = 0
        self._started = False
        self._done = False

    # ---------------------------------------------------------------- iteration

    def __aiter__(self) -> ResponseStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._items:
            return self._items.popleft()
        if not self._started:
            await self._start()
        while True:
            if self._frames:
                frame = self._frames.popleft()
                if frame is None:
                    self._no_responder()
                    continue
                if self._process(frame):
                    self._received_item = True
                    return self._items.popleft()
                continue
            if self._error is not None:
                self._release()
                raise self._error
            if self._done:
                raise StopAsyncIteration
            await self._wait()

    async def __aenter__(self) -> ResponseStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the stream; cancels the request on the server unless the server ended it
        (an END or ERROR frame, or it had no responder). Idempotent."""
        if self._started and not self._ended_remotely:
            await self._cancel_remote()
        self._done = True
        self._release()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` unless it already ended (the client calls this
        when the instance's key leaves the bucket)."""
        if self._done or self._error is not None:
            return
        self._error = error
        self._wake()

    # ---------------------------------------------------------------- internals

    async def _start(self) -> None:
        self._started = True
        client = self._client
        if client.closed:
            self._ended_remotely = True  # nothing was sent
            raise ClientClosedError(f"the client of {client.endpoint.path} was closed")
        if not client.knows(self.instance_id):
            # It left between the caller's choice and now; nothing was sent, so the
            # request may go elsewhere exactly as after a "no responders".
            self._ended_remotely = True
            raise InstanceGoneError(
                self.instance_id, f"not registered on {client.endpoint.path} (any more)"
            )
        if len(self._payload) > MAX_CARRIED_REQUEST_BYTES:
            # No instance would take it: nothing is sent.
            self._ended_remotely = True
            raise RequestTooLargeError(len(self._payload), MAX_CARRIED_REQUEST_BYTES)
        self._reply = client.runtime.inbox.open(self._on_frame)
        client.track(self, self.instance_id)
        nc, subject = client.runtime.nc, client.request_subject(self.instance_id)
        if not nc.max_payload or len(self._payload) <= nc.max_payload:
            await nc.publish(subject, self._payload, reply=self._reply)
            return
        parts = request_parts.split(self._payload, nc.max_payload)  # see request_parts
        for index, part in enumerate(parts):
            headers = request_parts.part_headers(index, len(parts))
            await nc.publish(subject, part, reply=self._reply, headers=headers)

    def _no_responder(self) -> None:
        self._ended_remotely = True
        self._client.mark_unreachable(self.instance_id)
        log.debug("instance %016x had no responder", self.instance_id)
        self._error = NoResponderError(self.instance_id)

    def _process(self, data: bytes) -> bool:
        """Decode one frame; True when it produced items."""
        try:
            seq, kind, body = wire.decode_frame(data)
        except Exception as exc:
            self._error = StreamProtocolError(f"malformed frame: {exc}")
            return False
        if seq != self._seq:
            if seq > self._seq:  # lost in transit: the stream cannot be trusted to go on
                self._error = FramesLostError(self.instance_id, self._seq, seq)
            else:
                self._error = StreamProtocolError(f"expected frame {self._seq}, got {seq}")
            return False
        if self._seq == 0:  # the instance answered: it is reachable
            self._client.mark_reachable(self.instance_id)
        self._seq += 1
        if kind is wire.FrameKind.DATA:
            self._items.append(self._decoder.decode(body))
            return True
        if kind is wire.FrameKind.BATCH:
            self._items.extend(self._batch_decoder.decode(body))
            return bool(self._items)
        if kind is wire.FrameKind.ACCEPTED:
            return False
        if kind is wire.FrameKind.END:
            self._done = True
            self._ended_remotely = True
            self._release()
            return False
        error_type, message = wire.decode_error(body)
        self._error = error_from_frame(self.instance_id, error_type, message)
        self._done = True
        self._ended_remotely = True
        return False

    async def _wait(self) -> None:
        """Wait for the next frame (or `fail`), at most the deadline that applies now."""
        if self._received_item:
            limit = self._item_timeout
        elif self._awaiting_acceptance:
            limit = self._accept_timeout
        else:
            limit = self._first_item_timeout
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        # A timer handle, not `asyncio.wait_for`: this runs once per token of every stream.
        timer = None if limit is None else waiter.get_loop().call_later(limit, self._expire, limit)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._waiter = None
        if isinstance(self._error, StreamTimeoutError):
            await self._cancel_remote()  # it may still be working on the request

    @property
    def _awaiting_acceptance(self) -> bool:
        """No frame yet, not even the ACCEPTED one, and an accept deadline applies."""
        return self._seq == 0 and self._accept_timeout is not None

    def _expire(self, limit: float) -> None:
        """The deadline passed with no frame (any frame would have resolved the waiter)."""
        waiter = self._waiter
        if waiter is None or waiter.done() or self._error is not None:
            return
        if self._awaiting_acceptance:
            self._client.mark_unreachable(self.instance_id)
            self._error = RequestNotAcceptedError(
                f"instance {self.instance_id:016x} did not confirm the request within "
                f"{limit:g}s (lost on its way, or the instance is frozen)",
                self.instance_id,
            )
        else:
            what = "next output" if self._received_item else "first output"
            self._error = StreamTimeoutError(
                f"instance {self.instance_id:016x} sent no {what} within {limit:g}s",
                self.instance_id,
            )
        waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_frame(self, frame: bytes | None) -> None:
        """Each frame of this stream (None: "no responders"), handed over by the inbox."""
        self._frames.append(frame)
        self._wake()

    async def _cancel_remote(self) -> None:
        if self._reply is None or self._cancel_sent:
            return
        self._cancel_sent = True
        data = wire.encode_control(self._reply, wire.ControlAction.STOP)
        try:
            await self._client.runtime.nc.publish(naming.control_subject(self.instance_id), data)
        except Exception as exc:
            log.debug("cancel of %s not sent: %s", self.request_id, exc)

    def _release(self) -> None:
        if self._started:
            self._client.untrack(self, self.instance_id)
        if self._reply is not None:
            self._client.runtime.inbox.close(self._reply)
