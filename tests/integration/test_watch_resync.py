"""A delete the live watch never reports is found by the watcher's periodic resync.

Why it matters: on a NATS cluster, a worker SIGKILLed just before a node restart had its
key expire while the node holding the frontend's watch consumer came back, and the
server's short-lived delete marker was gone before the consumer was. The frontend kept
the dead worker for good, and a request placed on it hung until its first-token deadline
(a CI chaos soak). Here the same blind spot is made on purpose: the key's message is
purged from the bucket's stream directly (a stream purge, not the bucket's own purge),
which places no marker, so no live watch can ever see it go. A watcher with `resync_s` reports it deleted after one resync and the
grace; one without keeps it.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from dynamo.runtime.kv import ensure_registry
from dynamo.runtime.watch import BucketWatcher

pytestmark = pytest.mark.integration

BUCKET = "resync_test"
HANG_GUARD_S = 20.0  # tells "reported" from "never reported", not fast from slow


async def test_a_key_gone_without_a_marker_is_reported_after_a_resync(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    kv = await ensure_registry(js, BUCKET, 1)
    await kv.put("instances.a", b"alive")
    await kv.put("instances.b", b"alive")
    deleted = asyncio.Event()
    seen_deleted: list[str] = []

    def on_delete(key: str) -> None:
        seen_deleted.append(key)
        deleted.set()

    resyncing = BucketWatcher(
        js, BUCKET, "instances.>", on_delete=on_delete, missing_grace_s=0.3, resync_s=0.5
    )
    live_only = BucketWatcher(js, BUCKET, "instances.>", missing_grace_s=0.3)
    try:
        await resyncing.start()
        await live_only.start()
        # Gone, and no marker says so.
        await js.purge_stream(f"KV_{BUCKET}", subject=f"$KV.{BUCKET}.instances.a")
        await asyncio.wait_for(deleted.wait(), HANG_GUARD_S)
        assert seen_deleted == ["instances.a"]
        assert set(resyncing.entries) == {"instances.b"}
        # The premise: nothing on the live watch ever said the key went.
        assert set(live_only.entries) == {"instances.a", "instances.b"}
    finally:
        await resyncing.close()
        await live_only.close()
        await js.delete_key_value(BUCKET)
        await nc.close()
