"""The calling side of an endpoint: the live instances, and one response stream per request.

`Client` mirrors the endpoint's instances from the discovery bucket (so
`instance_ids()` is a local read) and opens `ResponseStream`s:

* `direct(req, instance_id)`: send to that instance;
* `round_robin(req)`, `random(req)`: choose among the routable instances
  (`dynamo.runtime.selection`), then send there.

A stream talks to exactly one instance and never retries: where a request should go
next when its instance fails is a placement decision, made by the caller (the LLM
layer's engine client re-places or migrates through its router). The stream only reports
*why* it failed, with typed errors:

* `NoResponderError` (an `InstanceGoneError`) when the instance had no subscriber (NATS
  answers "no responders" at once; nothing was processed, so sending elsewhere, or to it
  again later, is safe; the instance is left out of `routable_ids()` for a pause of
  `SUSPECT_FIRST_S` to `SUSPECT_MAX_S`, and `wait_routable()` waits for the first pause to
  end);
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
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, Generic, Protocol, TypeVar, overload

from nats.aio.client import Client as NatsClient

from dynamo.runtime import naming, request_parts, wire
from dynamo.runtime.errors import (
    ClientClosedError,
    ConnectionLostError,
    FramesLostError,
    InstanceGoneError,
    NoInstancesError,
    NoResponderError,
    RequestNotAcceptedError,
    RequestTooLargeError,
    StreamProtocolError,
    StreamTimeoutError,
    error_from_frame,
)
from dynamo.runtime.inbox import Inbox
from dynamo.runtime.request_parts import MAX_CARRIED_REQUEST_BYTES
from dynamo.runtime.selection import RandomChoice, RoundRobin
from dynamo.runtime.watch import BucketWatcher

log = logging.getLogger(__name__)


class EndpointAddress(Protocol):
    """The endpoint a client talks to (`runtime.Endpoint`)."""

    @property
    def namespace(self) -> str: ...

    @property
    def component(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...


class ClientConnection(Protocol):
    """What a client needs of this process's runtime (`runtime.DistributedRuntime`): the
    NATS connection it publishes on, the shared reply inbox its streams receive on, the
    instance registry's watch and lease TTL, and word when the connection drops. A
    protocol, so that this module does not import the runtime that builds its clients."""

    nc: NatsClient
    inbox: Inbox
    lease_ttl: float

    def watch_bucket(
        self,
        bucket: str,
        key_filter: str = ">",
        *,
        on_put: Callable[[str, bytes], None] | None = None,
        on_delete: Callable[[str], None] | None = None,
    ) -> BucketWatcher: ...

    async def close_watcher(self, watcher: BucketWatcher) -> None: ...

    def add_disconnect_listener(self, listener: Callable[[], None]) -> None: ...

    def remove_disconnect_listener(self, listener: Callable[[], None]) -> None: ...


T = TypeVar("T")

SUSPECT_FIRST_S = 0.5
"""How long an instance that answered "no responders" is first left out of routing; each
probe after the pause that finds no responder again doubles it, up to `SUSPECT_MAX_S`. A
worker whose connection dropped is unsubscribed only until it reconnects (a second or so
on a cluster), and its key, put again unchanged, brings no event that would clear it."""

SUSPECT_MAX_S = 2.0
"""The longest pause between two probes of an instance that keeps answering "no
responders". A dead worker's key lives until its lease expires (18 s on a cluster); a
probe of it costs one immediate "no responders", while a pause as long as the lease
left a worker that had only reconnected, the only one of its model, a 503 for that long
(seen on a NATS cluster losing the node both the frontend and the worker were on)."""

InstancesListener = Callable[[list[int]], None]


class Client:
    """Client of one endpoint (namespace/component/endpoint)."""

    def __init__(self, runtime: ClientConnection, endpoint: EndpointAddress) -> None:
        self.runtime = runtime
        self.endpoint = endpoint
        self._instances: dict[int, wire.InstanceInfo] = {}
        self._ready: list[int] = []
        self._suspect: dict[int, float] = {}  # instance -> monotonic time it is excluded until
        self._strikes: dict[int, int] = {}  # instance -> failed probes in a row
        self._streams_by_instance: dict[int, set[ResponseStream[Any]]] = collections.defaultdict(
            set
        )
        self._round_robin = RoundRobin()
        self._random = RandomChoice()
        self._changed = asyncio.Event()
        self._listeners: list[InstancesListener] = []
        self._closed = False
        self._watcher = runtime.watch_bucket(
            naming.INSTANCES_BUCKET,
            naming.instance_key_filter(endpoint.namespace, endpoint.component, endpoint.name),
            on_put=self._on_put,
            on_delete=self._on_delete,
        )
        runtime.add_disconnect_listener(self.connection_lost)

    async def start(self) -> Client:
        await self._watcher.start()
        return self

    async def close(self) -> None:
        """Stop watching the endpoint. Every stream still open through this client ends
        with `ClientClosedError` at once (it could not learn of its instance's loss any
        more), and new streams are refused. Idempotent."""
        if self._closed:
            return
        self._closed = True
        open_streams = [s for streams in self._streams_by_instance.values() for s in streams]
        self._streams_by_instance.clear()
        for stream in open_streams:
            stream.fail(ClientClosedError(f"the client of {self.endpoint.path} was closed"))
        self.runtime.remove_disconnect_listener(self.connection_lost)
        await self.runtime.close_watcher(self._watcher)

    def connection_lost(self) -> None:
        """This process's NATS connection dropped: every open stream fails with
        `ConnectionLostError` (frames may have been lost meanwhile)."""
        for instance_id, streams in list(self._streams_by_instance.items()):
            for stream in list(streams):
                stream.fail(ConnectionLostError(instance_id))

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ instances

    @property
    def lease_ttl(self) -> float:
        """Seconds a dead instance's key outlives it (the runtime's lease TTL)."""
        return self.runtime.lease_ttl

    def instance_ids(self) -> list[int]:
        """Ready instances (registered and not draining), sorted."""
        return list(self._ready)

    def routable_ids(self) -> list[int]:
        """Ready instances minus those that just answered "no responders" (left out for
        `SUSPECT_FIRST_S`, doubling with each failed probe in a row up to `SUSPECT_MAX_S`,
        or until they re-register): where a new request may be sent."""
        if not self._suspect:
            return list(self._ready)
        now = time.monotonic()
        for instance_id, until in list(self._suspect.items()):
            if until <= now:
                del self._suspect[instance_id]
        return [i for i in self._ready if i not in self._suspect]

    def instances(self) -> dict[int, wire.InstanceInfo]:
        """Every known instance, ready or draining."""
        return dict(self._instances)

    def knows(self, instance_id: int) -> bool:
        """Whether `instance_id` is registered (ready or draining)."""
        return instance_id in self._instances

    async def wait_for_instances(
        self, timeout: float | None = None, min_count: int = 1
    ) -> list[int]:
        """Wait until at least `min_count` instances are ready; NoInstancesError on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._ready) < min_count:
            self._changed.clear()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise NoInstancesError(
                    f"{self.endpoint.path}: {len(self._ready)} instances after {timeout}s"
                )
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                continue
        return self.instance_ids()

    def add_listener(self, listener: InstancesListener) -> None:
        """Call `listener(ready_ids)` whenever the set of ready instances changes."""
        self._listeners.append(listener)

    async def watch(self) -> AsyncIterator[list[int]]:
        """Yield the ready instance ids now and after every change."""
        last: list[int] | None = None
        while True:
            current = self.instance_ids()
            if current != last:
                last = current
                yield current
            self._changed.clear()
            await self._changed.wait()

    def request_subject(self, instance_id: int) -> str:
        """The subject `instance_id` takes requests on (as it registered it)."""
        info = self._instances.get(instance_id)
        if info is not None:
            return info.subject
        ep = self.endpoint
        return naming.request_subject(ep.namespace, ep.component, ep.name, instance_id)

    def mark_unreachable(self, instance_id: int) -> None:
        """`instance_id` had no responder: leave it out of `routable_ids()` for a while
        (see `SUSPECT_FIRST_S`). Requests sent to it before it was left out answer "no
        responders" too: only the first answer after a pause counts as a failed probe
        (one reconnecting worker met by many requests at once would otherwise be left out
        as long as a dead one)."""
        now = time.monotonic()
        if self._suspect.get(instance_id, 0.0) > now:
            return
        strikes = self._strikes.get(instance_id, 0) + 1
        self._strikes[instance_id] = strikes
        pause = min(SUSPECT_MAX_S, SUSPECT_FIRST_S * 2 ** (strikes - 1))
        self._suspect[instance_id] = now + pause

    async def wait_routable(self, timeout: float, excluding: Collection[int] = ()) -> bool:
        """Wait until an instance not in `excluding` is routable: a left-out instance's
        pause ends, or the ready set changes (one registers, or a dead one's key expires).
        True when one is; False after `timeout` seconds, or at once when no instance
        outside `excluding` is ready."""
        deadline = time.monotonic() + timeout
        while not [i for i in self.routable_ids() if i not in excluding]:
            now = time.monotonic()
            waiting = [self._suspect.get(i, now) for i in self._ready if i not in excluding]
            if not waiting or now >= deadline:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait(), max(0.0, min(*waiting, deadline) - now)
                )
        return True

    def mark_reachable(self, instance_id: int) -> None:
        """`instance_id` answered a request: its "no responders" in a row start again."""
        self._strikes.pop(instance_id, None)

    def track(self, stream: ResponseStream[Any], instance_id: int) -> None:
        """Fail `stream` with `InstanceGoneError` if `instance_id` leaves the bucket."""
        self._streams_by_instance[instance_id].add(stream)

    def untrack(self, stream: ResponseStream[Any], instance_id: int) -> None:
        streams = self._streams_by_instance.get(instance_id)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._streams_by_instance[instance_id]

    def _on_put(self, key: str, value: bytes) -> None:
        try:
            info = wire.decode_instance(value)
        except Exception:
            log.warning("undecodable instance record %s ignored", key)
            return
        self._instances[info.instance_id] = info
        if info.status is wire.InstanceStatus.READY:
            self._suspect.pop(info.instance_id, None)
            self._strikes.pop(info.instance_id, None)
        self._refresh()

    def _on_delete(self, key: str) -> None:
        instance_id = int(key.rsplit(".", 1)[-1], 16)
        self._instances.pop(instance_id, None)
        self._suspect.pop(instance_id, None)
        self._strikes.pop(instance_id, None)
        self._refresh()
        for stream in list(self._streams_by_instance.pop(instance_id, ())):
            stream.fail(InstanceGoneError(instance_id, "its lease expired or it deregistered"))

    def _refresh(self) -> None:
        ready = sorted(
            i for i, info in self._instances.items() if info.status is wire.InstanceStatus.READY
        )
        if ready != self._ready:
            self._ready = ready
            for listener in self._listeners:
                try:
                    listener(list(ready))
                except Exception:
                    log.exception("instance listener failed")
        self._changed.set()

    # ------------------------------------------------------------------ requests

    @overload
    def direct(
        self,
        request: object,
        instance_id: int,
        *,
        response_type: type[T],
        request_id: str | None = ...,
        first_item_timeout: float | None = ...,
        item_timeout: float | None = ...,
        accept_timeout: float | None = ...,
    ) -> ResponseStream[T]: ...

    @overload
    def direct(
        self,
        request: object,
        instance_id: int,
        *,
        response_type: None = ...,
        request_id: str | None = ...,
        first_item_timeout: float | None = ...,
        item_timeout: float | None = ...,
        accept_timeout: float | None = ...,
    ) -> ResponseStream[Any]: ...

    def direct(
        self,
        request: object,
        instance_id: int,
        *,
        response_type: type[Any] | None = None,
        request_id: str | None = None,
        first_item_timeout: float | None = None,
        item_timeout: float | None = None,
        accept_timeout: float | None = None,
    ) -> ResponseStream[Any]:
        """A stream of `request` sent to `instance_id` (nothing is sent before the first
        `__anext__`). Items are decoded as `response_type` (plain data when None). The
        stream fails with `RequestNotAcceptedError` when the instance does not confirm
        the request within `accept_timeout` seconds, and with `StreamTimeoutError` when
        no frame arrives within `first_item_timeout` seconds before its first item or
        `item_timeout` seconds after one (None: wait as long as the instance holds its
        lease)."""
        return ResponseStream(
            self,
            request,
            instance_id,
            response_type=response_type,
            request_id=request_id,
            first_item_timeout=first_item_timeout,
            item_timeout=item_timeout,
            accept_timeout=accept_timeout,
        )

    def round_robin(self, request: object, **kwargs: Any) -> ResponseStream[Any]:
        """`direct` to the next routable instance in turn."""
        return self._to_one_of(request, self._round_robin.pick, kwargs)

    def random(self, request: object, **kwargs: Any) -> ResponseStream[Any]:
        """`direct` to a uniformly random routable instance."""
        return self._to_one_of(request, self._random.pick, kwargs)

    def _to_one_of(
        self, request: object, pick: Callable[[list[int]], int], kwargs: dict[str, Any]
    ) -> ResponseStream[Any]:
        candidates = self.routable_ids()
        if not candidates:
            raise NoInstancesError(f"no ready instance of {self.endpoint.path}")
        return self.direct(request, pick(candidates), **kwargs)


class ResponseStream(Generic[T]):
    """Async iterator over one request's responses from one instance. Nothing is sent
    until the first `__anext__`; `aclose()` before the end cancels the request there.

    The deadlines are inactivity limits, counted from when the reader starts waiting: a
    reader that is slow itself never makes the instance look silent."""

    def __init__(
        self,
        client: Client,
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
