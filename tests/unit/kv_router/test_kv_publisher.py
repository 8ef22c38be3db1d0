"""Worker-side publishers, with the transport replaced by recorders and the load
publisher's clock by one the test moves: what goes out, in which order, when, and how a
failed publish is repaired. The tests of the background loop wait on real time: for a
signalled change, the heartbeat of an engine that signals nothing, and the gap between two
reports."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dynamo.llm.kv_router.publisher import (
    MAX_EVENTS_PER_MESSAGE,
    RESYNC_CHUNK_BLOCKS,
    KvEventPublisher,
    LoadPublisher,
)
from dynamo.llm.protocols import (
    KvAllCleared,
    KvBlockRemoved,
    KvBlockStored,
    KvEventData,
    LoadMetrics,
    RouterEvent,
    decode,
    kv_events_of,
)
from dynamo.testing.clocks import FakeClock

WORKER = 9


class RecordingStream:
    """Duck-types `EventStream`: records publishes and purges, can fail on demand, and
    can play a stream the broker lost (`missing`: publishes fail until `ensure`)."""

    name = "test"

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.messages: list[list[int]] = []  # the event ids each published message held
        self.fail_next = 0
        self.missing = False

    async def ensure(self, runtime: Any) -> bool:
        self.log.append(("ensure", None))
        created, self.missing = self.missing, False
        return created

    async def publish(self, runtime: Any, subject: str, payload: bytes) -> int:
        if self.missing:
            raise ConnectionError("no stream")
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("broker away")
        events = kv_events_of(payload)
        self.messages.append([event.event_id for event in events])
        self.log.extend(("publish", event) for event in events)
        return len(self.log)

    async def purge_subject(self, runtime: Any, subject: str) -> None:
        self.log.append(("purge", subject))


def stored(event_id: int) -> RouterEvent:
    return RouterEvent(WORKER, event_id, KvBlockStored(block_hashes=[event_id]))


class ListeningRuntime:
    """Duck-types the runtime's reconnect listeners (the stream does the publishing)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[], Awaitable[None]]] = []

    def add_reconnect_listener(self, listener: Callable[[], Awaitable[None]]) -> None:
        self.listeners.append(listener)

    def remove_reconnect_listener(self, listener: Callable[[], Awaitable[None]]) -> None:
        self.listeners.remove(listener)


async def make_publisher() -> tuple[KvEventPublisher, RecordingStream]:
    stream = RecordingStream()
    runtime = ListeningRuntime()
    publisher = KvEventPublisher(runtime, "ns", "backend", WORKER, stream=stream)  # type: ignore[arg-type]
    await publisher.start()
    assert runtime.listeners == [publisher.resync]
    return publisher, stream


def published(stream: RecordingStream) -> list[tuple[str, int, list[int]]]:
    """(kind, event id, block hashes) of every event that reached the stream."""
    return [
        (type(e.data).__name__, e.event_id, _hashes(e.data))
        for op, e in stream.log
        if op == "publish"
    ]


def _hashes(data: KvEventData) -> list[int]:
    if isinstance(data, KvBlockStored | KvBlockRemoved):
        return list(data.block_hashes)
    return []


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


async def test_events_published_together_share_a_message_and_a_clear_travels_alone() -> None:
    publisher, stream = await make_publisher()
    clear = RouterEvent(WORKER, 2, KvAllCleared())
    await publisher.publish_many([stored(0), stored(1), clear, stored(3), stored(4)])
    await publisher.publish_many([stored(5)])
    assert stream.messages == [[0, 1], [2], [3, 4], [5]]
    assert [op for op, _ in stream.log].count("purge") == 1
    assert published(stream) == [
        ("KvBlockStored", 0, [0]),
        ("KvBlockStored", 1, [1]),
        ("KvAllCleared", 2, []),
        ("KvBlockStored", 3, [3]),
        ("KvBlockStored", 4, [4]),
        ("KvBlockStored", 5, [5]),
    ]
    assert publisher.stats.published == 6
    assert publisher.cached == {3, 4, 5}


async def test_a_long_run_of_events_is_split_into_bounded_messages() -> None:
    publisher, stream = await make_publisher()
    await publisher.publish_many([stored(i) for i in range(MAX_EVENTS_PER_MESSAGE + 3)])
    assert [len(ids) for ids in stream.messages] == [MAX_EVENTS_PER_MESSAGE, 3]
    assert [i for ids in stream.messages for i in ids] == list(range(MAX_EVENTS_PER_MESSAGE + 3))


async def test_after_a_failed_publish_the_whole_cache_is_announced_again() -> None:
    publisher, stream = await make_publisher()
    await publisher.publish(stored(1))
    stream.fail_next = 1
    with pytest.raises(ConnectionError):
        await publisher.publish(stored(2))  # lost: could have been a removal
    await publisher.publish(RouterEvent(WORKER, 3, KvBlockRemoved(block_hashes=[1])))
    # Purge, clear, then what the worker holds now (block 2, not the removed 1): the
    # removal itself is folded into the announcement, and ids keep increasing.
    assert published(stream) == [
        ("KvBlockStored", 1, [1]),
        ("KvAllCleared", 2, []),
        ("KvBlockStored", 3, [2]),
    ]
    assert ("purge", publisher.subject) in stream.log
    assert (publisher.stats.failures, publisher.stats.resyncs) == (1, 1)
    await publisher.publish(stored(4))  # back to normal: no more clears
    assert published(stream)[-1] == ("KvBlockStored", 4, [4])
    assert publisher.stats.resyncs == 1


async def test_a_reconnect_re_announces_every_cached_block_in_chunks() -> None:
    publisher, stream = await make_publisher()
    many = list(range(100, 100 + RESYNC_CHUNK_BLOCKS + 5))
    await publisher.publish(RouterEvent(WORKER, 0, KvBlockStored(block_hashes=many)))
    stream.log.clear()
    await publisher.resync()  # what the runtime calls after a reconnect
    assert [op for op, _ in stream.log[:2]] == ["ensure", "purge"]
    assert published(stream) == [
        ("KvAllCleared", 1, []),
        ("KvBlockStored", 2, many[:RESYNC_CHUNK_BLOCKS]),
        ("KvBlockStored", 3, many[RESYNC_CHUNK_BLOCKS:]),
    ]
    await publisher.publish(stored(1))  # the caller's id is behind: raised above the rest
    assert published(stream)[-1] == ("KvBlockStored", 4, [1])


async def test_an_event_that_met_a_lost_stream_is_published_once_it_is_recreated() -> None:
    publisher, stream = await make_publisher()
    await publisher.publish(stored(1))
    stream.missing = True  # the broker restarted without its store
    await publisher.publish(stored(2))  # no error: the stream is recreated at once
    assert published(stream)[-2:] == [("KvAllCleared", 2, []), ("KvBlockStored", 3, [1, 2])]
    assert (publisher.stats.streams_recreated, publisher.stats.failures) == (1, 0)


async def test_a_closed_publisher_no_longer_re_announces() -> None:
    publisher, stream = await make_publisher()
    await publisher.publish(stored(1))
    publisher.close()
    count = len(stream.log)
    await publisher.resync()
    assert len(stream.log) == count


class RecordingCore:
    """Duck-types the runtime's core publish: records reports, can fail on demand, and
    wakes waiters on each report so loop tests await a condition, not a duration."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, LoadMetrics]] = []
        self.fail_next = 0
        self.changed = asyncio.Event()
        self.on_sent: Callable[[], None] = lambda: None

    async def publish(self, subject: str, data: bytes) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("broker away")
        self.sent.append((subject, decode(data, LoadMetrics)))
        self.on_sent()
        self.changed.set()

    def blocks(self) -> list[int]:
        return [m.active_blocks for _, m in self.sent]


class LoadHarness:
    """A `LoadPublisher` on a recording core, a settable load and a fake clock."""

    INTERVAL_S = 0.5  # a binary fraction: clock arithmetic below is exact

    def __init__(self, *, min_gap_s: float = 0.02, interval_s: float = INTERVAL_S) -> None:
        self.core = RecordingCore()
        self.clock = FakeClock(now=1000.0)
        self.load = LoadMetrics(worker_id=WORKER, active_blocks=1)
        self.publisher = LoadPublisher(
            self.core,
            "ns",
            "backend",
            WORKER,
            lambda: self.load,
            interval_s=interval_s,
            min_gap_s=min_gap_s,
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


@pytest.mark.parametrize("interval_s, min_gap_s", [(0, 0.1), (1, 0), (-1, 0.1)])
def test_non_positive_periods_are_rejected(interval_s: float, min_gap_s: float) -> None:
    with pytest.raises(ValueError):
        LoadPublisher(
            RecordingCore(),
            "ns",
            "backend",
            WORKER,
            lambda: LoadMetrics(worker_id=WORKER),
            interval_s=interval_s,
            min_gap_s=min_gap_s,
        )


async def test_start_publishes_at_once_and_a_signalled_change_goes_out() -> None:
    h = LoadHarness(min_gap_s=0.001, interval_s=60.0)
    await h.publisher.start()
    try:
        assert h.core.blocks() == [1], "published before start returns"
        with pytest.raises(RuntimeError):
            await h.publisher.start()
        h.core.changed.clear()
        h.set_blocks(5)
        h.publisher.changed()
        await asyncio.wait_for(h.core.changed.wait(), timeout=5)
        assert h.core.blocks() == [1, 5], "the background loop sent the change"
    finally:
        await h.publisher.stop()
    await h.publisher.stop()  # idempotent


async def test_without_a_signal_nothing_is_sampled_until_the_heartbeat() -> None:
    """An idle engine signals nothing: the publisher sleeps until its heartbeat."""
    h = LoadHarness(min_gap_s=0.001, interval_s=60.0)
    samples = 0

    def counted() -> LoadMetrics:
        nonlocal samples
        samples += 1
        return h.load

    h.publisher = LoadPublisher(
        h.core, "ns", "backend", WORKER, counted, interval_s=0.3, min_gap_s=0.001
    )
    await h.publisher.start()
    try:
        await asyncio.sleep(0.15)
        assert samples == 1, "only the report at start"
        h.core.changed.clear()
        await asyncio.wait_for(h.core.changed.wait(), timeout=5)
        assert samples == 2 and h.core.blocks() == [1, 1], "then the heartbeat"
    finally:
        await h.publisher.stop()


async def test_changes_within_the_gap_go_out_once_with_the_latest_load() -> None:
    gap = 0.2
    h = LoadHarness(min_gap_s=gap, interval_s=60.0)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []
    h.core.on_sent = lambda: sent_at.append(loop.time())
    await h.publisher.start()
    try:
        h.set_blocks(5)
        h.publisher.changed()
        await wait_for_reports(h, 2)
        for blocks in (6, 7, 8):  # three steps inside the gap
            h.set_blocks(blocks)
            h.publisher.changed()
            await asyncio.sleep(0.01)
        await wait_for_reports(h, 3)
        await asyncio.sleep(gap * 1.5)
        assert h.core.blocks() == [1, 5, 8], "one report, with the load at its moment"
        assert sent_at[2] - sent_at[1] >= gap * 0.95, "not before the gap was out"
    finally:
        await h.publisher.stop()


async def wait_for_reports(h: LoadHarness, count: int) -> None:
    while len(h.core.sent) < count:
        h.core.changed.clear()
        await asyncio.wait_for(h.core.changed.wait(), timeout=5)
