"""`KvEventForwarder`: numbering, order, the opening clear, and surviving failed publishes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dynamo.llm.protocols import KvAllCleared, KvBlockRemoved, KvBlockStored, RouterEvent
from dynamo.mocker.kv_events import KvEventForwarder


class FakePublisher:
    """Records each `publish_many` call; a call holding an id of `fail_ids` fails whole."""

    def __init__(self, fail_ids: set[int] | None = None) -> None:
        self.events: list[RouterEvent] = []
        self.calls: list[list[int]] = []
        self.fail_ids = fail_ids or set()

    async def publish_many(self, events: Sequence[RouterEvent]) -> None:
        await asyncio.sleep(0)
        if any(event.event_id in self.fail_ids for event in events):
            raise ConnectionError("broker away")
        self.calls.append([event.event_id for event in events])
        self.events.extend(events)


async def test_events_are_numbered_in_order_after_an_opening_clear() -> None:
    publisher = FakePublisher()
    forwarder = KvEventForwarder(publisher, worker_id=7).start()
    forwarder.submit([KvBlockStored(block_hashes=[1, 2])])
    forwarder.submit([])
    forwarder.submit([KvBlockRemoved(block_hashes=[2]), KvBlockStored(block_hashes=[3])])
    assert not forwarder.idle
    assert await forwarder.flush()
    await forwarder.stop()
    assert [e.event_id for e in publisher.events] == [0, 1, 2, 3]
    assert {e.worker_id for e in publisher.events} == {7}
    assert [type(e.data) for e in publisher.events] == [
        KvAllCleared,
        KvBlockStored,
        KvBlockRemoved,
        KvBlockStored,
    ]
    assert forwarder.published == 4
    assert publisher.calls == [[0], [1], [2, 3]]  # one publish per step


async def test_a_failed_publish_is_counted_and_publishing_goes_on() -> None:
    publisher = FakePublisher(fail_ids={1})
    forwarder = KvEventForwarder(publisher, worker_id=1).start()
    forwarder.submit([KvBlockStored(block_hashes=[1]), KvBlockStored(block_hashes=[2])])
    forwarder.submit([KvBlockStored(block_hashes=[3])])
    assert await forwarder.flush()
    await forwarder.stop()
    assert [e.event_id for e in publisher.events] == [0, 3]  # the failed step's two are lost
    assert (forwarder.published, forwarder.failures) == (2, 2)


class SwallowingPublisher:
    """Loses a cancellation, as `asyncio.wait_for` (used by nats-py requests) can on
    Python 3.11 when the awaited result arrives together with the cancel."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def publish_many(self, events: Sequence[RouterEvent]) -> None:
        self.entered.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass


async def test_stop_returns_even_when_the_publisher_swallows_the_cancellation() -> None:
    publisher = SwallowingPublisher()
    forwarder = KvEventForwarder(publisher, worker_id=3).start()
    await publisher.entered.wait()
    began = asyncio.get_running_loop().time()
    await asyncio.wait_for(forwarder.stop(), 1.0)
    assert asyncio.get_running_loop().time() - began < 0.5
