"""A resilient view of a KV bucket (or a filtered part of it).

`BucketWatcher` keeps `entries` (key -> value) equal to the bucket's content and calls
`on_put(key, value)` / `on_delete(key)` on every change. It survives broker restarts: the
watch is recreated on every reconnect (and whenever it fails), each time starting with a
full snapshot that is diffed against what was known, so a key that vanished while we were
disconnected is reported as deleted and nothing is reported twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from dynamo.runtime.kv import ensure_registry
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

OnPut = Callable[[str, bytes], None]
OnDelete = Callable[[str], None]

_RETRY_S = 0.5


class BucketWatcher:
    """Mirror of the keys of `bucket` matching `key_filter` (NATS wildcards allowed)."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        key_filter: str = ">",
        *,
        on_put: OnPut | None = None,
        on_delete: OnDelete | None = None,
    ) -> None:
        self._js = js
        self.bucket = bucket
        self.key_filter = key_filter
        self._on_put = on_put
        self._on_delete = on_delete
        self.entries: dict[str, bytes] = {}
        self._synced = asyncio.Event()
        self._restart = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

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

    async def _run(self) -> None:
        while not self._closed:
            self._restart.clear()
            try:
                kv = await ensure_registry(self._js, self.bucket)
                await self._watch_until_restart(kv)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("watch of %s/%s failed (%s); retrying", self.bucket, self.key_filter, exc)
                await asyncio.sleep(_RETRY_S)

    async def _watch_until_restart(self, kv: KeyValue) -> None:
        watcher = await kv.watch(self.key_filter)
        snapshot: dict[str, bytes] | None = {}
        restart = asyncio.ensure_future(self._restart.wait())
        try:
            while not restart.done():
                update = asyncio.ensure_future(watcher.updates(timeout=None))
                done, _ = await asyncio.wait({update, restart}, return_when=asyncio.FIRST_COMPLETED)
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
            with contextlib.suppress(Exception):
                await watcher.stop()

    def _apply_snapshot(self, snapshot: dict[str, bytes]) -> None:
        for key in [k for k in self.entries if k not in snapshot]:
            self._delete(key)
        for key, value in snapshot.items():
            self._put(key, value)
        self._synced.set()

    def _put(self, key: str, value: bytes) -> None:
        if self.entries.get(key) == value:
            return
        self.entries[key] = value
        if self._on_put is not None:
            self._safe(self._on_put, key, value)

    def _delete(self, key: str) -> None:
        if self.entries.pop(key, None) is None:
            return
        if self._on_delete is not None:
            self._safe(self._on_delete, key)

    @staticmethod
    def _safe(callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("bucket watcher callback failed")
