"""A resilient view of a KV bucket (or a filtered part of it).

`BucketWatcher` keeps `entries` (key -> value) equal to the bucket's content and calls
`on_put(key, value)` / `on_delete(key)` on every change. It survives broker restarts: the
watch is recreated on every reconnect (and whenever it fails), each time starting with a
full snapshot that is diffed against what was known, so a key that vanished while we were
disconnected is reported as deleted and nothing is reported twice.

A broker restarted without its store comes back empty, and the snapshot taken right
after the reconnect may be older than its owners' re-puts (each restores its leased keys
when it reconnects, at the latest on its next heartbeat). Reporting those keys deleted
would make every worker leave and come back: a model vanishes from the frontend for a
moment, its clients and routers are rebuilt. So after a *re*-watch, a key missing from
the snapshot is only reported deleted if it is still missing `missing_grace_s` later
(the lease TTL: by then a live owner has put it again); an explicit delete or expiry
seen on the live watch is reported at once.

The live watch can also miss a delete without any reconnect of ours: a key's expiry is
reported by a marker the server keeps for a moment, and when the node holding the watch's
consumer restarts around that moment (a NATS cluster losing a node), the consumer comes
back after the marker is gone, or the marker is never placed while the stream elects a
leader. The key is gone from the bucket but stays in `entries` forever: a frontend would
keep a dead worker, and a request waiting on it would hang until its own deadline. So a
watcher given `resync_s` places its watch again that often, and its snapshot is diffed
like a re-watch's (same grace): a vanished key is reported within `resync_s` plus the
grace, whatever the markers did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from dynamo.runtime.backoff import Backoff
from dynamo.runtime.kv import ensure_registry
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

OnPut = Callable[[str, bytes], None]
OnDelete = Callable[[str], None]

# A failed watch is placed again after 0.5 s, then 1 s, then every 2 s: quick after a
# broker restart, and not a flood while a cluster elects a stream leader.
WATCH_RETRY = Backoff(initial_s=0.5, maximum_s=2.0)

STOP_TIMEOUT_S = 5.0
"""Longest the old watch may take to stop before its replacement is placed anyway."""

WATCH_RESYNC_S = 30.0
"""How often the runtime's watchers place their watch again (`BucketWatcher.resync_s`):
the bound on how long a delete the live watch missed goes unseen, before the grace. A new
watch costs one consumer and a snapshot of the watched keys, a few dozen small entries."""


@dataclass(eq=False)
class BucketWatcher:
    """Mirror of the keys of `bucket` matching `key_filter` (NATS wildcards allowed)."""

    js: JetStreamContext
    bucket: str
    key_filter: str = ">"
    _: KW_ONLY
    on_put: OnPut | None = None
    on_delete: OnDelete | None = None
    missing_grace_s: float = 0.0
    resync_s: float | None = None  # place the watch again this often (None: only on restart)
    replicas: int = 1  # of the bucket, should this watcher be first to create it
    entries: dict[str, bytes] = field(init=False, default_factory=dict)
    # Keys a re-watch's snapshot lacked, with the timer that reports them deleted.
    _missing: dict[str, asyncio.TimerHandle] = field(init=False, default_factory=dict)
    _synced: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    # Full snapshots applied, over every watch placed.
    _snapshots: int = field(init=False, default=0)
    _restart: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = field(init=False, default=None)
    _closed: bool = field(init=False, default=False)

    async def start(self, timeout: float | None = 10.0) -> None:
        """Start watching and wait for the first full snapshot."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"watch-{self.bucket}")
        await asyncio.wait_for(self._synced.wait(), timeout)

    def restart(self) -> None:
        """Recreate the watch (call after a reconnect); the next snapshot is diffed."""
        self._restart.set()

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(self._task)
        self._task = None
        for timer in self._missing.values():
            timer.cancel()
        self._missing.clear()

    async def _run(self) -> None:
        failures = 0
        while not self._closed:
            self._restart.clear()
            snapshots_before = self._snapshots
            try:
                kv = await ensure_registry(self.js, self.bucket, self.replicas)
                await self._watch_until_restart(kv)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A warning, not a debug line: a watch that keeps failing is why a
                # frontend never learns of a model, and the log must say so. A watch
                # that had delivered its snapshot starts the schedule again.
                failures = 1 if self._snapshots > snapshots_before else failures + 1
                delay = WATCH_RETRY.delay(failures)
                log.warning(
                    "watch of %s/%s failed (attempt %d): %s; retrying in %.1fs",
                    self.bucket,
                    self.key_filter,
                    failures,
                    exc or type(exc).__name__,
                    delay,
                )
                # A reconnect (`restart`) cuts the wait short: the broker is back now.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._restart.wait(), delay)

    async def _watch_until_restart(self, kv: KeyValue) -> None:
        """Apply the watch's updates until a restart is asked for or `resync_s` passes
        (then `_run` places it again, and the new snapshot is diffed)."""
        watcher = await kv.watch(self.key_filter)
        snapshot: dict[str, bytes] | None = {}
        restart = asyncio.ensure_future(self._restart.wait())
        loop = asyncio.get_running_loop()
        resync_at = None if self.resync_s is None else loop.time() + self.resync_s
        try:
            while not restart.done():
                update = asyncio.ensure_future(watcher.updates(timeout=None))
                timeout = None if resync_at is None else max(0.0, resync_at - loop.time())
                done, _ = await asyncio.wait(
                    {update, restart}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if update not in done:
                    update.cancel()
                    break
                entry = update.result()
                if entry is None:  # end of the initial snapshot
                    if snapshot is not None:
                        self._apply_snapshot(snapshot)
                        snapshot = None
                    continue
                deleted = entry.operation in ("DEL", "PURGE")
                if snapshot is not None:
                    if deleted:
                        snapshot.pop(entry.key, None)
                    else:
                        snapshot[entry.key] = entry.value or b""
                elif deleted:
                    self._delete(entry.key)
                else:
                    self._put(entry.key, entry.value or b"")
        finally:
            restart.cancel()
            # Bounded: a stop that never returns would stall this loop for good, and with
            # it every later watch (and resync) of the bucket.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher.stop(), STOP_TIMEOUT_S)

    def _apply_snapshot(self, snapshot: dict[str, bytes]) -> None:
        self._snapshots += 1
        rewatch = self._synced.is_set() and self.missing_grace_s > 0
        gone = [k for k in self.entries if k not in snapshot]
        if self._synced.is_set():
            missed = [k for k, v in snapshot.items() if self.entries.get(k) != v]
            if missed or gone:  # what the live watch did not say (or a reconnect hid)
                log.info(
                    "watch of %s/%s placed again: %d key(s) new or changed, %d missing",
                    self.bucket, self.key_filter, len(missed), len(gone),
                )  # fmt: skip
        for key in gone:
            if rewatch:
                self._expect_back(key)
            else:
                self._delete(key)
        for key, value in snapshot.items():
            self._put(key, value)
        self._synced.set()

    def _expect_back(self, key: str) -> None:
        """`key` is missing from a re-watch's snapshot: delete it unless it is put again
        within the grace period."""
        if key in self._missing:
            return
        loop = asyncio.get_running_loop()
        self._missing[key] = loop.call_later(self.missing_grace_s, self._still_missing, key)

    def _still_missing(self, key: str) -> None:
        if self._missing.pop(key, None) is not None:
            log.info("%s/%s: not put again after a reconnect; gone", self.bucket, key)
            self._delete(key)

    def _put(self, key: str, value: bytes) -> None:
        timer = self._missing.pop(key, None)
        if timer is not None:
            timer.cancel()
        if self.entries.get(key) == value:
            return
        self.entries[key] = value
        if self.on_put is not None:
            self._safe(self.on_put, key, value)

    def _delete(self, key: str) -> None:
        timer = self._missing.pop(key, None)
        if timer is not None:
            timer.cancel()
        if self.entries.pop(key, None) is None:
            return
        if self.on_delete is not None:
            self._safe(self.on_delete, key)

    @staticmethod
    def _safe(callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("bucket watcher callback failed")
