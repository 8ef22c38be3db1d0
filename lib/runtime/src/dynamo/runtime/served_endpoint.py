"""`ServedEndpoint`: a handler served on an endpoint, from registration to deregistration.

Separate from `runtime.py`, which hands out the endpoint handles: serving is its own
lifecycle (register the instance under a leased key, re-end recent streams after a
reconnect, mark it draining, drain or abandon the requests in flight, forget the key),
run on its own `EndpointServer`. It reaches the runtime and the endpoint through
the protocols below, so that this module does not import the runtime that creates it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nats.aio.client import Client as NatsClient

from dynamo.runtime import naming, wire
from dynamo.runtime.naming import EndpointAddress
from dynamo.runtime.server import EndpointServer, Handler, InflightRegistry

log = logging.getLogger(__name__)


class ServingRuntime(Protocol):
    """What a served endpoint needs of this process's runtime (`runtime.DistributedRuntime`):
    the connection and in-flight registry its server runs on, the instance id it registers
    under, its leased registry key, a hook run after every reconnect, and the runtime's
    list of what it serves (drained at shutdown)."""

    nc: NatsClient
    instance_id: int
    inflight: InflightRegistry

    def add_reconnect_listener(self, listener: Callable[[], None]) -> None: ...

    def remove_reconnect_listener(self, listener: Callable[[], None]) -> None: ...

    async def put_leased(self, bucket: str, key: str, value: bytes) -> None: ...

    async def delete_leased(self, bucket: str, key: str) -> None: ...

    def add_served(self, served: ServedEndpoint) -> None: ...

    def remove_served(self, served: ServedEndpoint) -> None: ...


class EndpointHandle(EndpointAddress, Protocol):
    """The endpoint a handler is served on (`runtime.Endpoint`): its address, and the
    runtime it belongs to."""

    @property
    def runtime(self) -> ServingRuntime: ...


@dataclass
class ServedEndpoint:
    """A live registration of a handler on an endpoint."""

    endpoint: EndpointHandle
    handler: Handler
    request_type: type | None
    metadata: dict[str, Any]
    max_inflight: int | None = None
    address: str = ""
    server: EndpointServer | None = field(default=None, init=False)
    _stopped: bool = field(default=False, init=False)

    @property
    def instance_id(self) -> int:
        return self.endpoint.runtime.instance_id

    @property
    def key(self) -> str:
        ep = self.endpoint
        return naming.instance_key(ep.namespace, ep.component, ep.name, self.instance_id)

    def _info(self, status: wire.InstanceStatus) -> wire.InstanceInfo:
        ep = self.endpoint
        return wire.InstanceInfo(
            namespace=ep.namespace,
            component=ep.component,
            endpoint=ep.name,
            instance_id=self.instance_id,
            subject=naming.request_subject(ep.namespace, ep.component, ep.name, self.instance_id),
            status=status,
            hostname=socket.gethostname(),
            address=self.address,
            pid=os.getpid(),
            metadata=self.metadata,
        )

    async def start(self) -> None:
        runtime = self.endpoint.runtime
        info = self._info(wire.InstanceStatus.READY)
        self.server = EndpointServer(
            runtime.nc,
            info.subject,
            self.instance_id,
            self.handler,
            self.request_type,
            runtime.inflight,
            max_inflight=self.max_inflight,
        )
        await self.server.start()
        runtime.add_reconnect_listener(self._probe_recent_ends)
        await runtime.put_leased(naming.INSTANCES_BUCKET, self.key, wire.encode_instance(info))
        runtime.add_served(self)
        log.info(
            "serving %s as instance %s", self.endpoint.path, naming.instance_hex(self.instance_id)
        )

    def _probe_recent_ends(self) -> None:
        """After a reconnect: a stream whose END was lost with the old connection learns
        it from a late END (`ReplyCoalescer.probe_recent_ends`)."""
        if self.server is not None:
            sent = self.server.coalescer.probe_recent_ends()
            if sent:
                log.info("%s: reconnected; re-ended %d recent streams", self.endpoint.path, sent)

    async def mark_draining(self) -> None:
        """Stay alive but leave every client's routing set; new requests see no responder."""
        if self._stopped or self.server is None:
            return
        runtime = self.endpoint.runtime
        await self.server.stop_accepting()
        with contextlib.suppress(Exception):
            await runtime.put_leased(
                naming.INSTANCES_BUCKET,
                self.key,
                wire.encode_instance(self._info(wire.InstanceStatus.DRAINING)),
            )

    async def abandon(self) -> None:
        """Stop serving without a NATS call (the broker is gone): requests in flight are
        cancelled and the key expires with its lease."""
        if self._stopped:
            return
        self._stopped = True
        runtime = self.endpoint.runtime
        if self.server is not None:
            await self.server.drain(0)
        runtime.remove_reconnect_listener(self._probe_recent_ends)
        runtime.remove_served(self)

    async def stop(self, drain_timeout: float = 10.0) -> None:
        """Deregister at once, finish in-flight requests (bounded), then forget the key."""
        if self._stopped:
            return
        await self.mark_draining()
        self._stopped = True
        runtime = self.endpoint.runtime
        assert self.server is not None
        cancelled = await self.server.drain(drain_timeout)
        if cancelled:
            log.warning(
                "%s: cancelled %d requests still running after %.1fs",
                self.endpoint.path,
                cancelled,
                drain_timeout,
            )
        runtime.remove_reconnect_listener(self._probe_recent_ends)
        await runtime.delete_leased(naming.INSTANCES_BUCKET, self.key)
        runtime.remove_served(self)
