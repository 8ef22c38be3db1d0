"""Keys that live exactly as long as this process: the heartbeat behind discovery.

`LeaseKeeper` remembers every leased key this process put and re-puts each one every
`ttl / 3` seconds with a `Nats-TTL` of `ttl`. If the process dies, the heartbeats stop and
the broker expires the keys within `ttl` (plus its expiry-scan granularity), so every
watcher sees them go. Graceful shutdown deletes them at once.

After a broker restart the buckets may be gone (they are in memory); `restore()` — called
on reconnect and whenever a heartbeat fails — recreates them and puts every key again.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError
from nats.js.errors import Error as JetStreamError

from dynamo.runtime.kv import ensure_registry, key_subject, retry_transient, ttl_header
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_RETRY_FAILED_BEAT_S = 0.5

_PUT_TIMEOUT_S = 2.0
_MAX_BEAT_INTERVAL_S = 2.0


class LeaseKeeper:
    """Owns this process's leased keys and keeps them alive."""

    def __init__(self, nc: NatsClient, ttl_s: float, *, replicas: int = 1) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        self._nc = nc
        # Registry calls answer within the put timeout or not at all: during a JetStream
        # failover a slow answer is no answer, and the next beat should come soon.
        self._js = nc.jetstream(timeout=_PUT_TIMEOUT_S)
        self.ttl_s = ttl_s
        self.replicas = replicas  # of a bucket this keeper has to create
        self._keys: dict[tuple[str, str], bytes] = {}
        self._known_buckets: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.heartbeats = 0
        self.failures = 0

    @property
    def interval_s(self) -> float:
        """A third of the TTL, and never more than `_MAX_BEAT_INTERVAL_S`: with a long
        (cluster) lease the last put is then recent whenever a failover starts, which is
        what keeps a key alive through the election that follows."""
        return min(self.ttl_s / 3.0, _MAX_BEAT_INTERVAL_S)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dynamo-lease-heartbeat")

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        """Put (or update) a leased key now; it is kept alive until `delete` or `close`.

        A put the stream did not answer (no responder, or no ack in time) is retried for
        a while (`retry_transient`): a replicated bucket just created, or one whose
        leader's node was just lost, takes a moment before it takes writes."""
        self._keys[(bucket, key)] = value
        await retry_transient(
            lambda: self._put_one(bucket, key, value), what=f"putting {bucket}/{key}"
        )

    async def delete(self, bucket: str, key: str) -> None:
        """Stop leasing `key` and delete it now (watchers see it go at once)."""
        if self._keys.pop((bucket, key), None) is None:
            return
        try:
            kv = await ensure_registry(self._js, bucket, self.replicas)
            await kv.delete(key)
        except (TimeoutError, NatsError, JetStreamError) as exc:
            log.warning("could not delete %s/%s (it expires with its lease): %s", bucket, key, exc)

    def holds(self, bucket: str, key: str) -> bool:
        return (bucket, key) in self._keys

    async def restore(self) -> None:
        """Put every key again, recreating buckets (after a broker restart)."""
        async with self._lock:
            self._known_buckets.clear()
            for (bucket, key), value in list(self._keys.items()):
                try:
                    await self._put_one(bucket, key, value)
                except (TimeoutError, NatsError, JetStreamError) as exc:
                    log.warning("restoring lease %s/%s failed: %s", bucket, key, exc)
                    return
        log.info("restored %d leased keys", len(self._keys))

    async def close(self, *, delete: bool = True) -> None:
        """Stop heartbeating; delete every key unless `delete` is False."""
        await cancel_and_wait(self._task)
        self._task = None
        if delete:
            for bucket, key in list(self._keys):
                await self.delete(bucket, key)
        self._keys.clear()

    async def _put_one(self, bucket: str, key: str, value: bytes) -> None:
        if bucket not in self._known_buckets:
            await ensure_registry(self._js, bucket, self.replicas)
            self._known_buckets.add(bucket)
        await self._js.publish(
            key_subject(bucket, key), value, timeout=_PUT_TIMEOUT_S, headers=ttl_header(self.ttl_s)
        )

    async def _beat(self) -> bool:
        """Put every key once; True when all puts succeeded."""
        async with self._lock:
            puts = [self._put_one(b, k, v) for (b, k), v in list(self._keys.items())]
            results = await asyncio.gather(*puts, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        self.heartbeats += 1
        if errors:
            self.failures += 1
            log.warning(
                "lease heartbeat: %d of %d puts failed (%s)", len(errors), len(puts), errors[0]
            )
            if self._nc.is_connected:
                # The bucket may have vanished with a broker restart: recreate on next beat.
                self._known_buckets.clear()
        return not errors

    async def _run(self) -> None:
        delay = self.interval_s
        while True:
            await asyncio.sleep(delay)
            delay = self.interval_s
            if not self._keys or not self._nc.is_connected:
                continue
            try:
                if not await self._beat():
                    # A failed beat is retried soon, not a third of a TTL later: on a
                    # cluster the registry's stream may just have elected a new leader,
                    # and the keys' time to live is running out.
                    delay = min(self.interval_s, _RETRY_FAILED_BEAT_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the heartbeat die
                log.exception("lease heartbeat failed")
