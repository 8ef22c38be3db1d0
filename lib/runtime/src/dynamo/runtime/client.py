"""The calling side of an endpoint: the live instances, and one response stream per request.

`Client` mirrors the endpoint's instances from the discovery bucket (so
`instance_ids()` is a local read) and opens `ResponseStream`s:

* `direct(req, instance_id)`: send to that instance;
* `round_robin(req)`, `random(req)`: choose among the routable instances
  (`dynamo.runtime.selection`), then send there.

A stream talks to exactly one instance and never retries, and fails with typed errors
saying why (`dynamo.runtime.response_stream`); the client's part in that is to pause the
instances that answered "no responders" (`routable_ids()`, `wait_routable()`) and to fail
the streams whose instance left the bucket, or whose connection dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, Protocol, TypeVar, overload

from nats.aio.client import Client as NatsClient

from dynamo.runtime import naming, wire
from dynamo.runtime.errors import (
    ClientClosedError,
    ConnectionLostError,
    InstanceGoneError,
    NoInstancesError,
)
from dynamo.runtime.inbox import Inbox
from dynamo.runtime.naming import EndpointAddress
from dynamo.runtime.response_stream import ResponseStream
from dynamo.runtime.selection import RandomChoice, RoundRobin
from dynamo.runtime.watch import BucketWatcher

log = logging.getLogger(__name__)


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

    def direct(self, request: object, instance_id: int, **options: Any) -> ResponseStream[Any]:
        """A stream of `request` sent to `instance_id` (nothing is sent before the first
        `__anext__`). Items are decoded as `response_type` (plain data when None). The
        stream fails with `RequestNotAcceptedError` when the instance does not confirm
        the request within `accept_timeout` seconds, and with `StreamTimeoutError` when
        no frame arrives within `first_item_timeout` seconds before its first item or
        `item_timeout` seconds after one (None: wait as long as the instance holds its
        lease). The keyword options, typed by the overloads above, are
        `ResponseStream`'s, passed on as they are."""
        return ResponseStream(self, request, instance_id, **options)

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
