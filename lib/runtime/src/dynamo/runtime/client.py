"""The calling side of an endpoint: pick an instance, send, and iterate the response stream.

`Client` mirrors the endpoint's live instances from the discovery bucket (so
`instance_ids()` is a local read) and hands out `ResponseStream`s:

* `round_robin(req)`, `random(req)`: choose among ready instances; if the chosen one has
  no subscriber any more (NATS answers "no responders" at once), the next one is tried —
  nothing was processed, so retrying is safe;
* `direct(req, instance_id)`: that instance or `InstanceGoneError`.

A stream fails with `InstanceGoneError` when its instance's key leaves the bucket (lease
expired or deregistered) before the END frame: a worker that was SIGKILLed mid-stream is
detected within the lease window instead of hanging the caller forever. Closing the
stream early (`aclose()`, `async with`, or breaking out and closing) sends a STOP on the
instance's control subject, which cancels the handler.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random as _random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg

from dynamo.runtime import naming, wire
from dynamo.runtime.errors import (
    InstanceGoneError,
    NoInstancesError,
    RemoteError,
    StreamProtocolError,
    StreamTimeoutError,
)
from dynamo.runtime.watch import BucketWatcher

if TYPE_CHECKING:
    from dynamo.runtime.runtime import DistributedRuntime, Endpoint

log = logging.getLogger(__name__)

InstancesListener = Callable[[list[int]], None]


class Client:
    """Client of one endpoint (namespace/component/endpoint)."""

    def __init__(self, runtime: DistributedRuntime, endpoint: Endpoint) -> None:
        self._runtime = runtime
        self.endpoint = endpoint
        self._instances: dict[int, wire.InstanceInfo] = {}
        self._ready: list[int] = []
        self._suspect: dict[int, float] = {}  # instance -> monotonic time it is excluded until
        self._streams_by_instance: dict[int, set[ResponseStream]] = collections.defaultdict(set)
        self._rr = itertools.count()
        self._changed = asyncio.Event()
        self._listeners: list[InstancesListener] = []
        self._watcher = BucketWatcher(
            runtime.js,
            naming.INSTANCES_BUCKET,
            naming.instance_key_filter(endpoint.namespace, endpoint.component, endpoint.name),
            on_put=self._on_put,
            on_delete=self._on_delete,
        )

    async def start(self) -> Client:
        await self._watcher.start()
        self._runtime._register_watcher(self._watcher)
        return self

    async def close(self) -> None:
        self._runtime._unregister_watcher(self._watcher)
        await self._watcher.close()

    # ------------------------------------------------------------------ instances

    def instance_ids(self) -> list[int]:
        """Ready (routable) instances, sorted."""
        return list(self._ready)

    def instances(self) -> dict[int, wire.InstanceInfo]:
        """Every known instance, ready or draining."""
        return dict(self._instances)

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
            except asyncio.TimeoutError:
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

    def _on_put(self, key: str, value: bytes) -> None:
        try:
            info = wire.decode_instance(value)
        except Exception:
            log.warning("undecodable instance record %s ignored", key)
            return
        self._instances[info.instance_id] = info
        if info.status is wire.InstanceStatus.READY:
            self._suspect.pop(info.instance_id, None)
        self._refresh()

    def _on_delete(self, key: str) -> None:
        instance_id = int(key.rsplit(".", 1)[-1], 16)
        self._instances.pop(instance_id, None)
        self._suspect.pop(instance_id, None)
        self._refresh()
        for stream in list(self._streams_by_instance.pop(instance_id, ())):
            stream._fail(InstanceGoneError(instance_id, "its lease expired or it deregistered"))

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

    def _routable(self) -> list[int]:
        if not self._suspect:
            return self._ready
        now = time.monotonic()
        for instance_id, until in list(self._suspect.items()):
            if until <= now:
                del self._suspect[instance_id]
        return [i for i in self._ready if i not in self._suspect]

    def _mark_suspect(self, instance_id: int) -> None:
        self._suspect[instance_id] = time.monotonic() + self._runtime.lease_ttl

    # ------------------------------------------------------------------ requests

    def round_robin(self, request: Any, **kwargs: Any) -> ResponseStream:
        """Send to the next ready instance in turn."""
        return ResponseStream(self, request, _RoundRobin(self), **kwargs)

    def random(self, request: Any, **kwargs: Any) -> ResponseStream:
        """Send to a uniformly random ready instance."""
        return ResponseStream(self, request, _Random(), **kwargs)

    def direct(self, request: Any, instance_id: int, **kwargs: Any) -> ResponseStream:
        """Send to `instance_id` only."""
        return ResponseStream(self, request, _Direct(instance_id), **kwargs)

    def generate(
        self, request: Any, instance_id: int | None = None, **kwargs: Any
    ) -> ResponseStream:
        """`direct` when an instance is given, else `round_robin`."""
        if instance_id is None:
            return self.round_robin(request, **kwargs)
        return self.direct(request, instance_id, **kwargs)

    def _subject(self, instance_id: int) -> str:
        info = self._instances.get(instance_id)
        if info is not None:
            return info.subject
        ep = self.endpoint
        return naming.request_subject(ep.namespace, ep.component, ep.name, instance_id)


class _RoundRobin:
    def __init__(self, client: Client) -> None:
        self._client = client

    def pick(self, candidates: list[int], tried: set[int]) -> int | None:
        left = [i for i in candidates if i not in tried]
        if not left:
            return None
        return left[next(self._client._rr) % len(left)]


class _Random:
    def pick(self, candidates: list[int], tried: set[int]) -> int | None:
        left = [i for i in candidates if i not in tried]
        return _random.choice(left) if left else None


class _Direct:
    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id

    def pick(self, candidates: list[int], tried: set[int]) -> int | None:
        return None if self.instance_id in tried else self.instance_id


_NO_RESPONDERS = object()


class ResponseStream:
    """Async iterator over one request's responses. Nothing is sent until the first
    `__anext__`; `aclose()` before the end cancels the request on the server."""

    def __init__(
        self,
        client: Client,
        request: Any,
        selector: _RoundRobin | _Random | _Direct,
        *,
        response_type: Any = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self._client = client
        self._selector = selector
        self.request_id = request_id or uuid.uuid4().hex
        self._payload = wire.encode_request(self.request_id, request)
        self._decoder = wire.decoder_for(response_type)
        self._timeout = timeout
        self.instance_id: int | None = None
        self._reply: str | None = None
        self._frames: collections.deque[Any] = collections.deque()
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._seq = 0
        self._started = False
        self._done = False
        self._tried: set[int] = set()

    # ---------------------------------------------------------------- iteration

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> Any:
        if self._items:
            return self._items.popleft()
        if not self._started:
            await self._start()
        while True:
            if self._frames:
                frame = self._frames.popleft()
                if frame is _NO_RESPONDERS:
                    await self._retry_elsewhere()
                    continue
                if self._process(frame):
                    return self._items.popleft()
                continue
            if self._error is not None:
                await self._finish()
                raise self._error
            if self._done:
                raise StopAsyncIteration
            await self._wait()

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the stream; cancels the request on the server if it had not ended."""
        if self._started and not self._done and self._error is None:
            await self._cancel_remote()
        self._done = True
        await self._finish()

    # ---------------------------------------------------------------- internals

    async def _start(self) -> None:
        self._started = True
        runtime = self._client._runtime
        self._reply = runtime._open_stream(self)
        await self._send()

    async def _send(self) -> None:
        candidates = self._client._routable()
        instance_id = self._selector.pick(candidates, self._tried)
        if instance_id is None:
            await self._finish()
            if isinstance(self._selector, _Direct):
                raise InstanceGoneError(self._selector.instance_id, "no responder")
            raise NoInstancesError(f"no ready instance of {self._client.endpoint.path}")
        if isinstance(self._selector, _Direct) and instance_id not in self._client._instances:
            await self._finish()
            raise NoInstancesError(
                f"instance {instance_id:016x} of {self._client.endpoint.path} is unknown"
            )
        self._tried.add(instance_id)
        self.instance_id = instance_id
        self._client._streams_by_instance[instance_id].add(self)
        assert self._reply is not None
        await self._client._runtime.nc.publish(
            self._client._subject(instance_id), self._payload, reply=self._reply
        )

    async def _retry_elsewhere(self) -> None:
        gone = self.instance_id
        assert gone is not None
        self._client._streams_by_instance[gone].discard(self)
        self._client._mark_suspect(gone)
        log.debug("instance %016x had no responder; retrying", gone)
        if isinstance(self._selector, _Direct):
            self._error = InstanceGoneError(gone, "no responder on its subject")
            return
        await self._send()

    def _process(self, data: bytes) -> bool:
        """Decode one frame; True when it produced items."""
        try:
            seq, kind, body = wire.decode_frame(data)
        except Exception as exc:
            self._error = StreamProtocolError(f"malformed frame: {exc}")
            return False
        if seq != self._seq:
            self._error = StreamProtocolError(
                f"expected frame {self._seq}, got {seq} (frames lost)"
            )
            return False
        self._seq += 1
        if kind is wire.FrameKind.DATA:
            self._items.append(self._decoder.decode(body))
            return True
        if kind is wire.FrameKind.BATCH:
            decode = self._decoder.decode
            self._items.extend(decode(raw) for raw in wire.decode_batch(body))
            return bool(self._items)
        if kind is wire.FrameKind.END:
            self._done = True
            self._release()
            return False
        error_type, message = wire.decode_error(body)
        if error_type == wire.SHUTDOWN_ERROR_TYPE:
            self._error = InstanceGoneError(self.instance_id or 0, message)
        else:
            self._error = RemoteError(message, error_type)
        self._done = True
        return False

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        try:
            if self._timeout is None:
                await self._waiter
            else:
                await asyncio.wait_for(self._waiter, self._timeout)
        except asyncio.TimeoutError:
            self._error = StreamTimeoutError(
                f"no response from instance {self.instance_id or 0:016x} within {self._timeout}s"
            )
            await self._cancel_remote()
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _deliver(self, msg: Msg) -> None:
        """Called by the runtime's inbox subscription for each message of this stream."""
        headers = msg.headers
        if headers and headers.get("Status") == "503":
            self._frames.append(_NO_RESPONDERS)
        else:
            self._frames.append(msg.data)
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._done or self._error is not None:
            return
        self._error = error
        self._wake()

    async def _cancel_remote(self) -> None:
        if self.instance_id is None or self._reply is None:
            return
        data = wire.encode_control(self._reply, wire.ControlAction.STOP)
        try:
            await self._client._runtime.nc.publish(naming.control_subject(self.instance_id), data)
        except Exception as exc:
            log.debug("cancel of %s not sent: %s", self.request_id, exc)

    def _release(self) -> None:
        if self.instance_id is not None:
            self._client._streams_by_instance[self.instance_id].discard(self)
        if self._reply is not None:
            self._client._runtime._close_stream(self._reply)

    async def _finish(self) -> None:
        self._release()
