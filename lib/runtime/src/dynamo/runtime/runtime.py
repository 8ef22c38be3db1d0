"""`DistributedRuntime`: one process's connection to the system, and the
namespace → component → endpoint handles built on it.

One runtime per process. It owns the NATS connection (reconnecting forever), the process's
instance id, the lease heartbeat, the `Inbox` through which every response stream of this
process arrives, and the control subscription through which clients cancel requests
served here (applied to the `InflightRegistry` its endpoints share). Everything is restored after a broker restart: subscriptions by
nats-py itself, leased keys by `LeaseKeeper.restore`, watches by `BucketWatcher.restart`,
and whatever else lived on the broker (tokenizer files, event streams, consumers) by the
reconnect listeners of their owners. A restarted broker may have lost everything (the
launch scripts give it a temporary store), so the restore assumes nothing survived.

Beside it: the connection's own settings and its bounded close (`runtime_connection.py`),
the lease TTL policy (`lease_ttl.py`), and a handler's registration on an endpoint
(`ServedEndpoint`, `served_endpoint.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig
from nats.js.errors import APIError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from nats.nuid import NUID

from dynamo.runtime import naming
from dynamo.runtime.client import Client
from dynamo.runtime.errors import RuntimeClosedError
from dynamo.runtime.inbox import Inbox
from dynamo.runtime.kv import (
    ensure_registry,
    is_replica_shortage,
    replica_error,
    retry_transient,
    wait_for_stream_leader,
)
from dynamo.runtime.lease_ttl import default_lease_ttl, warn_short_cluster_lease
from dynamo.runtime.leases import LeaseKeeper
from dynamo.runtime.nats_address import nats_url_from_env
from dynamo.runtime.nats_options import NatsConnectOptions, redact_url
from dynamo.runtime.runtime_connection import (
    close_connection_bounded,
    open_reconnecting_connection,
)
from dynamo.runtime.served_endpoint import ServedEndpoint
from dynamo.runtime.server import Handler, InflightRegistry
from dynamo.runtime.tasks import cancel_and_wait
from dynamo.runtime.watch import WATCH_RESYNC_S, BucketWatcher

log = logging.getLogger(__name__)

ReconnectListener = Callable[[], Awaitable[None] | None]


class DistributedRuntime:
    """A process's handle on NATS. Create with `await DistributedRuntime.connect(url)`."""

    def __init__(self, nc: NatsClient, *, lease_ttl: float, name: str, replicas: int = 1) -> None:
        self.nc = nc
        # Replica count of every bucket and stream this process creates (`--nats-replicas`).
        self.replicas = replicas
        self.js: JetStreamContext = nc.jetstream()
        self.name = name
        self.lease_ttl = lease_ttl
        self.instance_id = secrets.randbits(63) or 1
        self.inbox = Inbox(NUID().next().decode())
        self.inflight = InflightRegistry()
        self._served: list[ServedEndpoint] = []
        self._watchers: set[BucketWatcher] = set()
        self._reconnect_listeners: list[ReconnectListener] = []
        self._disconnect_listeners: list[Callable[[], None]] = []
        self._restore_task: asyncio.Task[None] | None = None
        self.reconnects = 0  # completed reconnects (logs, debug views, tests)
        self._leases = LeaseKeeper(nc, lease_ttl, replicas=replicas)
        self._closed = False
        self._kv_cache: dict[str, KeyValue] = {}
        self._disconnected = asyncio.Event()  # set from a disconnect until the reconnect

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        *,
        lease_ttl: float | None = None,
        name: str = "dynamo",
        connect_timeout: float = 5.0,
        wait_for_server: float = 0.0,
        options: NatsConnectOptions | None = None,
    ) -> DistributedRuntime:
        """Connect to NATS at `url` (default `$NATS_SERVER` or nats://127.0.0.1:4222)
        with `options`' credentials and TLS (default: the `NATS_*` variables).

        Waits up to `wait_for_server` seconds for the server to come up (useful when
        processes start together), then raises ConnectionError naming the URL (redacted);
        a server that refuses the credentials or the TLS settings raises
        `NatsRefusedError` at once; contradictory settings raise ConfigError. Once
        connected, reconnects are retried forever.
        """
        server = url or nats_url_from_env()
        nats_options = NatsConnectOptions.from_env() if options is None else options
        nats_options.check_url(server)
        holder: dict[str, DistributedRuntime] = {}

        async def on_reconnected() -> None:
            if "rt" in holder:
                await holder["rt"]._on_reconnected()

        async def on_disconnected() -> None:
            if "rt" in holder:
                holder["rt"]._on_disconnected()

        nc = await open_reconnecting_connection(
            server,
            nats_options,
            name=name,
            connect_timeout=connect_timeout,
            wait_for_server=wait_for_server,
            reconnected_cb=on_reconnected,
            disconnected_cb=on_disconnected,
        )
        ttl = lease_ttl or default_lease_ttl(nats_options.replicas)
        warn_short_cluster_lease(ttl, nats_options.replicas)
        runtime = cls(nc, lease_ttl=ttl, name=name, replicas=nats_options.replicas)
        holder["rt"] = runtime
        await runtime._start()
        return runtime

    async def _start(self) -> None:
        await self.inbox.start(self.nc)
        await self.nc.subscribe(naming.control_subject(self.instance_id), cb=self._on_control)
        self._leases.start()
        log.info(
            "runtime %s connected to %s as instance %s (lease %.1fs)",
            self.name,
            redact_url(self.nc.connected_url.netloc) if self.nc.connected_url else "?",
            naming.instance_hex(self.instance_id),
            self.lease_ttl,
        )

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected and not self._closed

    async def wait_disconnected(self) -> None:
        """Return once the connection to NATS is lost (at once if it is lost now).

        Lets a caller give up on NATS calls that started while connected: nats-py does
        not fail a request in flight when the connection drops, it lets it time out."""
        if not self.nc.is_connected:
            return
        await self._disconnected.wait()

    @property
    def instance_hex(self) -> str:
        return naming.instance_hex(self.instance_id)

    async def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Deregister, finish in-flight requests (up to `drain_timeout`), disconnect."""
        if self._closed:
            return
        for served in list(self._served):
            await served.mark_draining()
        for served in list(self._served):
            await served.stop(drain_timeout)
        await self._stop_background(delete_keys=True)
        try:
            await self.nc.drain()
        except Exception:  # reconnecting, or the flush after draining failed: not closed
            await close_connection_bounded(self.nc)
        log.info("runtime %s shut down", self.name)

    async def abandon(self) -> None:
        """Stop everything this runtime runs without one call to NATS: for when the
        broker is gone (`shutdown` would wait out a timeout per call). Requests in flight
        are cancelled, the keys expire with their leases, the connection is closed, and no
        task of this runtime is left running. Idempotent."""
        if self._closed:
            return
        for served in list(self._served):
            await served.abandon()
        await self._stop_background(delete_keys=False)
        await close_connection_bounded(self.nc)
        log.info(
            "runtime %s abandoned its connection (its keys expire with their leases)", self.name
        )

    async def _stop_background(self, *, delete_keys: bool) -> None:
        """Stop the restore, the lease heartbeat (deleting the keys now, or leaving them
        to expire) and the watches, and close the inbox: all but the connection."""
        await cancel_and_wait(self._restore_task)
        await self._leases.close(delete=delete_keys)
        for watcher in list(self._watchers):
            await watcher.close()
        self._closed = True
        self.inbox.close_all()

    def add_reconnect_listener(self, listener: ReconnectListener) -> None:
        """Run `listener()` after every reconnect (after leases and watches are restored).

        Listeners of one reconnect run concurrently, so one that retries for a while
        (re-uploading files the broker lost) does not hold up the others. A listener
        still running when the connection drops again is cancelled."""
        self._reconnect_listeners.append(listener)

    def remove_reconnect_listener(self, listener: ReconnectListener) -> None:
        """Stop calling `listener` (its owner closed). Unknown listeners are ignored."""
        with contextlib.suppress(ValueError):
            self._reconnect_listeners.remove(listener)

    def add_disconnect_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` (synchronously, on the event loop) whenever the connection to
        NATS drops: response streams open then may have lost frames."""
        self._disconnect_listeners.append(listener)

    def remove_disconnect_listener(self, listener: Callable[[], None]) -> None:
        """Stop calling `listener`. Unknown listeners are ignored."""
        with contextlib.suppress(ValueError):
            self._disconnect_listeners.remove(listener)

    def _on_disconnected(self) -> None:
        self._disconnected.set()
        if not self._closed:
            log.warning("disconnected from NATS; reconnecting")
        for listener in list(self._disconnect_listeners):
            try:
                listener()
            except Exception:
                log.exception("disconnect listener %r failed", listener)

    async def _on_reconnected(self) -> None:
        """nats-py's reconnect callback. It runs inside nats-py's reconnect loop, so the
        restore is only started here: a slow restore must not stall that loop, and a
        restore cut short by another disconnect is replaced by the next one."""
        self._disconnected.clear()
        if self._closed:
            return
        self.reconnects += 1
        previous, self._restore_task = self._restore_task, None
        if previous is not None and not previous.done():
            previous.cancel()
        self._restore_task = asyncio.create_task(self._restore(), name="dynamo-restore")

    async def _restore(self) -> None:
        log.info("reconnected to NATS; restoring leases, watches and listeners")
        self._kv_cache.clear()
        try:
            await self._leases.restore()
        except Exception:  # the heartbeat puts them again on its next beat
            log.exception("restoring leases after a reconnect failed")
        for watcher in list(self._watchers):
            watcher.restart()
        listeners = list(self._reconnect_listeners)
        results = await asyncio.gather(
            *(_call_listener(listener) for listener in listeners), return_exceptions=True
        )
        for listener, result in zip(listeners, results, strict=True):
            if isinstance(result, Exception):
                log.error("reconnect listener %r failed: %s", listener, result, exc_info=result)

    # ------------------------------------------------------------------ handles

    def namespace(self, name: str) -> Namespace:
        return Namespace(self, naming.check_name("namespace", name))

    def add_served(self, served: ServedEndpoint) -> None:
        """Track `served` (it started), so that `shutdown` drains it and `abandon` stops it."""
        self._served.append(served)

    def remove_served(self, served: ServedEndpoint) -> None:
        """Forget `served` (it stopped). Unknown endpoints are ignored."""
        with contextlib.suppress(ValueError):
            self._served.remove(served)

    # ------------------------------------------------------------------ KV and leases

    async def key_value(self, bucket: str) -> KeyValue:
        """A registry bucket (created on first use)."""
        kv = self._kv_cache.get(bucket)
        if kv is None:
            kv = await ensure_registry(self.js, bucket, self.replicas)
            self._kv_cache[bucket] = kv
        return kv

    async def put_leased(self, bucket: str, key: str, value: bytes) -> None:
        """Put a key that lives as long as this process (heartbeated; expires if it dies)."""
        self._check_open()
        await self._leases.put(bucket, key, value)

    async def delete_leased(self, bucket: str, key: str) -> None:
        await self._leases.delete(bucket, key)

    def watch_bucket(
        self,
        bucket: str,
        key_filter: str = ">",
        *,
        on_put: Callable[[str, bytes], None] | None = None,
        on_delete: Callable[[str], None] | None = None,
    ) -> BucketWatcher:
        """A watcher restarted on reconnect and every `WATCH_RESYNC_S` (a delete the
        live watch missed is found then); call `await watcher.start()`. A key missing
        after a reconnect or a resync is given one lease TTL to be put again before it
        counts as deleted (its owner restores it when it reconnects too)."""
        watcher = BucketWatcher(
            self.js,
            bucket,
            key_filter,
            on_put=on_put,
            on_delete=on_delete,
            missing_grace_s=self.lease_ttl,
            resync_s=WATCH_RESYNC_S,
            replicas=self.replicas,
        )
        self._watchers.add(watcher)
        return watcher

    async def close_watcher(self, watcher: BucketWatcher) -> None:
        """Stop a watcher made by `watch_bucket` (no longer restarted on reconnect)."""
        self._watchers.discard(watcher)
        await watcher.close()

    # ------------------------------------------------------------------ object store

    async def object_store(self, bucket: str) -> ObjectStore:
        """An object store bucket (file storage; created on first use with this
        process's replica count)."""
        try:
            store = await self.js.object_store(bucket)
        except Exception:
            store = await self._create_object_store(bucket)
        # Whoever created it (this process, another worker of it, another process) may have
        # done so a moment ago: a put before its replicated stream has a leader finds no
        # responder.
        await wait_for_stream_leader(self.js, f"OBJ_{bucket}", self.replicas)
        return store

    async def _create_object_store(self, bucket: str) -> ObjectStore:
        try:
            return await retry_transient(
                lambda: self.js.create_object_store(
                    bucket, config=ObjectStoreConfig(replicas=self.replicas)
                ),
                what=f"creating object store {bucket}",
            )
        except APIError as exc:
            if is_replica_shortage(exc):
                raise replica_error(f"object store {bucket}", self.replicas, exc) from None
            raise

    # ------------------------------------------------------------------ core pub/sub

    async def publish(self, subject: str, data: bytes) -> None:
        await self.nc.publish(subject, data)

    async def subscribe(
        self, subject: str, callback: Callable[[Msg], Awaitable[None]], queue: str = ""
    ) -> Subscription:
        return await self.nc.subscribe(subject, queue=queue, cb=callback)

    # ------------------------------------------------------------------ internals

    async def _on_control(self, msg: Msg) -> None:
        self.inflight.dispatch_control(msg.data)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the runtime is shut down")


async def _call_listener(listener: ReconnectListener) -> None:
    result = listener()
    if result is not None:
        await result


@dataclass(frozen=True)
class Namespace:
    runtime: DistributedRuntime
    name: str

    def component(self, name: str) -> Component:
        return Component(self.runtime, self.name, naming.check_name("component", name))


@dataclass(frozen=True)
class Component:
    runtime: DistributedRuntime
    namespace: str
    name: str

    def endpoint(self, name: str) -> Endpoint:
        return Endpoint(
            self.runtime, self.namespace, self.name, naming.check_name("endpoint", name)
        )

    def subject(self, suffix: str) -> str:
        """A core-NATS subject scoped to this component (e.g. for load metrics)."""
        return f"{naming.SUBJECT_ROOT}.{self.namespace}.{self.name}.{suffix}"


@dataclass(frozen=True)
class Endpoint:
    runtime: DistributedRuntime
    namespace: str
    component: str
    name: str

    @property
    def path(self) -> str:
        return naming.endpoint_prefix(self.namespace, self.component, self.name)

    async def serve(
        self,
        handler: Handler,
        *,
        request_type: type | None = None,
        metadata: dict[str, Any] | None = None,
        max_inflight: int | None = None,
        address: str = "",
    ) -> ServedEndpoint:
        """Serve `handler` on this endpoint and register the instance (leased), with
        `address` as the address other hosts reach this process at. With `max_inflight`,
        requests beyond that many in flight are refused at once (`InstanceOverloadedError`
        at the caller)."""
        served = ServedEndpoint(
            self, handler, request_type, metadata or {}, max_inflight, address=address
        )
        await served.start()
        return served

    async def client(self, *, wait_for_instances: float | None = None) -> Client:
        """A started client; optionally wait that long for a first instance."""
        client = await Client(self.runtime, self).start()
        if wait_for_instances is not None:
            await client.wait_for_instances(wait_for_instances)
        return client
