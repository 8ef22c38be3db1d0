"""Worker-side publishers, with the transport replaced by recorders and the load
publisher's clock by one the test moves: what goes out, in which order, when, and how a
failed publish is repaired. Nothing here waits on real time except the one test that
checks `start()` runs the background loop, and that one waits for the report itself."""

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
    """Duck-types the runtime's core publish: records reports, can fail on demand, and
    wakes waiters on each report so loop tests await a condition, not a duration."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, LoadMetrics]] = []
        self.fail_next = 0
        self.changed = asyncio.Event()

    async def publish(self, subject: str, data: bytes) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("broker away")
        self.sent.append((subject, decode(data, LoadMetrics)))
        self.changed.set()

    def blocks(self) -> list[int]:
        return [m.active_blocks for _, m in self.sent]


class FakeClock:
    """A clock that only moves when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LoadHarness:
    """A `LoadPublisher` on a recording core, a settable load and a fake clock."""

    INTERVAL_S = 0.5  # a binary fraction: clock arithmetic below is exact

    def __init__(self, *, poll_s: float = 0.02) -> None:
        self.core = RecordingCore()
        self.clock = FakeClock()
        self.load = LoadMetrics(worker_id=WORKER, active_blocks=1)
        self.publisher = LoadPublisher(
            self.core,
            "ns",
            "backend",
            WORKER,
            lambda: self.load,
            interval_s=self.INTERVAL_S,
            poll_s=poll_s,
            clock=self.clock,
        )

    def set_blocks(self, active_blocks: int) -> None:
        self.load = LoadMetrics(worker_id=WORKER, active_blocks=active_blocks)


async def test_a_changed_load_goes_out_at_the_next_sample() -> None:
    h = LoadHarness()
    assert await h.publisher.publish_if_due(force=True), "published at start"
    assert not await h.publisher.publish_if_due(), "unchanged and not due: nothing sent"
    h.set_blocks(5)
    assert await h.publisher.publish_if_due(), "a change goes out without waiting"
    assert not await h.publisher.publish_if_due()
    assert h.core.blocks() == [1, 5]
    assert h.publisher.published == 2


async def test_an_unchanged_load_is_repeated_once_per_interval() -> None:
    h = LoadHarness()
    await h.publisher.publish_if_due(force=True)
    h.clock.now += h.INTERVAL_S / 2
    assert not await h.publisher.publish_if_due(), "heartbeat not yet due"
    h.clock.now += h.INTERVAL_S / 2
    assert await h.publisher.publish_if_due(), "heartbeat due after exactly one interval"
    assert not await h.publisher.publish_if_due(), "and not again at the same instant"
    h.clock.now += h.INTERVAL_S
    assert await h.publisher.publish_if_due()
    assert h.core.blocks() == [1, 1, 1]


async def test_a_change_restarts_the_heartbeat_interval() -> None:
    h = LoadHarness()
    await h.publisher.publish_if_due(force=True)
    h.clock.now += h.INTERVAL_S / 2
    h.set_blocks(5)
    assert await h.publisher.publish_if_due()
    h.clock.now += h.INTERVAL_S / 2
    assert not await h.publisher.publish_if_due(), "interval counts from the last report"
    h.clock.now += h.INTERVAL_S / 2
    assert await h.publisher.publish_if_due()
    assert h.core.blocks() == [1, 5, 5]


async def test_a_failed_report_is_retried_at_the_next_sample() -> None:
    h = LoadHarness()
    await h.publisher.publish_if_due(force=True)
    h.set_blocks(5)
    h.core.fail_next = 1
    assert not await h.publisher.publish_if_due(), "broker away: nothing went out"
    assert await h.publisher.publish_if_due(), "the lost change is sent on the next try"
    assert h.core.blocks() == [1, 5]
    assert (h.publisher.published, h.publisher.failures) == (2, 1)


async def test_reports_go_to_the_workers_load_subject() -> None:
    h = LoadHarness()
    await h.publisher.publish_if_due(force=True)
    h.set_blocks(2)
    await h.publisher.publish_if_due()
    assert {subject for subject, _ in h.core.sent} == {h.publisher.subject}
    assert all(m.worker_id == WORKER for _, m in h.core.sent)


@pytest.mark.parametrize("interval_s, poll_s", [(0, 0.1), (1, 0), (-1, 0.1)])
def test_non_positive_periods_are_rejected(interval_s: float, poll_s: float) -> None:
    with pytest.raises(ValueError):
        LoadPublisher(
            RecordingCore(),
            "ns",
            "backend",
            WORKER,
            lambda: LoadMetrics(worker_id=WORKER),
            interval_s=interval_s,
            poll_s=poll_s,
        )


async def test_start_publishes_at_once_and_the_loop_keeps_sampling() -> None:
    h = LoadHarness(poll_s=0.001)
    await h.publisher.start()
    try:
        assert h.core.blocks() == [1], "published before start returns"
        with pytest.raises(RuntimeError):
            await h.publisher.start()
        h.core.changed.clear()
        h.set_blocks(5)
        await asyncio.wait_for(h.core.changed.wait(), timeout=5)
        assert h.core.blocks() == [1, 5], "the background loop sent the change"
    finally:
        await h.publisher.stop()
    await h.publisher.stop()  # idempotent
