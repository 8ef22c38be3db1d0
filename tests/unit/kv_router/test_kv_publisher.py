"""Worker-side publishers, with the transport replaced by recorders: what goes out, in
which order, and how a failed publish is repaired."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dynamo.llm.kv_router.publisher import KvEventPublisher, LoadPublisher
from dynamo.llm.protocols import (
    KvAllCleared,
    KvBlockStored,
    LoadMetrics,
    RouterEvent,
    decode,
)

WORKER = 9


class RecordingStream:
    """Duck-types `EventStream`: records publishes and purges, can fail on demand."""

    name = "test"

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.fail_next = 0

    async def ensure(self, runtime: Any) -> None:
        self.log.append(("ensure", None))

    async def publish(self, runtime: Any, subject: str, payload: bytes) -> int:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("broker away")
        self.log.append(("publish", decode(payload, RouterEvent)))
        return len(self.log)

    async def purge_subject(self, runtime: Any, subject: str) -> None:
        self.log.append(("purge", subject))


def stored(event_id: int) -> RouterEvent:
    return RouterEvent(WORKER, event_id, KvBlockStored(block_hashes=[event_id]))


async def make_publisher() -> tuple[KvEventPublisher, RecordingStream]:
    stream = RecordingStream()
    publisher = KvEventPublisher(object(), "ns", "backend", WORKER, stream=stream)  # type: ignore[arg-type]
    await publisher.start()
    return publisher, stream


async def test_a_clear_purges_the_subject_before_it_is_published() -> None:
    publisher, stream = await make_publisher()
    await publisher.publish(RouterEvent(WORKER, 0, KvAllCleared()))
    await publisher.publish(stored(1))
    kinds = [(op, type(arg.data).__name__ if op == "publish" else arg) for op, arg in stream.log]
    assert kinds == [
        ("ensure", None),
        ("purge", publisher.subject),
        ("publish", "KvAllCleared"),
        ("publish", "KvBlockStored"),
    ]


async def test_after_a_failed_publish_routers_are_told_to_forget() -> None:
    publisher, stream = await make_publisher()
    await publisher.publish(stored(1))
    stream.fail_next = 1
    with pytest.raises(ConnectionError):
        await publisher.publish(stored(2))  # lost: could have been a removal
    await publisher.publish(stored(3))
    published = [arg for op, arg in stream.log if op == "publish"]
    assert [(type(e.data).__name__, e.event_id) for e in published] == [
        ("KvBlockStored", 1),
        ("KvAllCleared", 2),
        ("KvBlockStored", 3),
    ]
    assert (publisher.stats.failures, publisher.stats.resyncs) == (1, 1)
    await publisher.publish(stored(4))  # back to normal: no more clears
    assert stream.log[-1][1].event_id == 4 and publisher.stats.resyncs == 1


class RecordingCore:
    def __init__(self) -> None:
        self.sent: list[tuple[str, LoadMetrics]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append((subject, decode(data, LoadMetrics)))


async def test_load_is_published_on_change_and_as_a_heartbeat() -> None:
    core = RecordingCore()
    current = LoadMetrics(worker_id=WORKER, active_blocks=1)
    publisher = LoadPublisher(
        core, "ns", "backend", WORKER, lambda: current, interval_s=0.3, poll_s=0.02
    )
    await publisher.start()
    try:
        assert [m.active_blocks for _, m in core.sent] == [1], "published at start"
        current = LoadMetrics(worker_id=WORKER, active_blocks=5)
        await asyncio.sleep(0.1)
        assert [m.active_blocks for _, m in core.sent] == [1, 5], "a change goes out at once"
        await asyncio.sleep(0.35)
        assert len(core.sent) == 3, "unchanged load is repeated once per interval"
    finally:
        await publisher.stop()
    assert {subject for subject, _ in core.sent} == {publisher.subject}
