"""Router replicas share their bookings (`ReplicaBooks`, `RouterReplicaSync`).

Claims: a booking another replica made weighs on its worker here, so a replica sends the
next request elsewhere; its prefill and its end apply too; a replica's own messages
(echoed back by NATS) change nothing; equal request ids of two replicas do not collide;
a replica that stops beating has its bookings dropped after `miss_limit` intervals, one
that leaves at once; a replica that joins late gets the others' bookings (prefilled ones
included) from a snapshot; a heartbeat that disagrees with what a replica holds (a lost
message) makes it ask for a snapshot, which repairs the books; a lone replica publishes
nothing but heartbeats; over a bus, a burst of bookings goes out as one message.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from kv_cards import BLOCK_SIZE

from dynamo.llm.kv_router import replica_books
from dynamo.llm.kv_router.replica_books import ReplicaBooks, remote_key
from dynamo.llm.kv_router.replica_sync import ReplicaSyncSettings, RouterReplicaSync
from dynamo.llm.kv_router.scheduler import KvScheduler
from dynamo.llm.kv_router.worker_spec import KvWorkerSpec
from dynamo.llm.protocols import (
    BookingChange,
    BookingChanges,
    BookingSnapshot,
    ReplicaHeartbeat,
    ReplicaLeaving,
    ReplicaSyncData,
    ReplicaSyncMessage,
    SequenceBooked,
    SequenceFreed,
    SequencePrefilled,
    SnapshotRequest,
    decode,
    encode,
)
from dynamo.testing.clocks import FakeClock

B = BLOCK_SIZE
PROMPT = list(range(1000, 1000 + 4 * B))  # 4 full blocks
WORKERS = [1, 2]


class Replica:
    """A scheduler, its sync books, and the changes it would publish (its outbox)."""

    def __init__(self, replica_id: str, clock: FakeClock) -> None:
        self.scheduler = KvScheduler(B, rng=random.Random(0), clock=clock)
        for worker in WORKERS:
            self.scheduler.update_worker(KvWorkerSpec(worker, B))
        self.books = ReplicaBooks(self.scheduler, replica_id, clock=clock)
        self.outbox: list[ReplicaSyncData] = []
        self.scheduler.add_booking_observer(self)

    def booking_changed(self, change: BookingChange) -> None:
        if self.books.local_change(change):
            self.outbox.append(BookingChanges([change]))

    def message(self, data: ReplicaSyncData) -> ReplicaSyncMessage:
        return ReplicaSyncMessage(self.books.replica_id, data)

    def send_to(self, other: Replica) -> list[ReplicaSyncData]:
        """Deliver the outbox to `other`; returns what `other` answers."""
        answers: list[ReplicaSyncData] = []
        items, self.outbox = self.outbox, []
        for data in items:
            answers += other.books.receive(self.message(data))
        return answers

    def active(self, worker: int) -> tuple[int, int]:
        """(requests, blocks) booked on `worker`."""
        seqs = self.scheduler.sequences.get(worker)
        return (seqs.active_requests, seqs.active_blocks) if seqs is not None else (0, 0)


def meet(a: Replica, b: Replica) -> None:
    """Each has heard the other (what their start-up hellos achieve)."""
    for x, y in ((a, b), (b, a)):
        for answer in y.books.receive(x.message(x.books.heartbeat())):
            x.books.receive(y.message(answer))


def met(clock: FakeClock) -> tuple[Replica, Replica]:
    """Replicas "a" and "b" that have heard each other."""
    a, b = Replica("a", clock), Replica("b", clock)
    meet(a, b)
    return a, b


def booked_on_both(a: Replica, b: Replica) -> int:
    """Schedule "cmpl-1" (`PROMPT`) on `a` and deliver its booking to `b`; returns the
    worker it was booked on."""
    worker = a.scheduler.schedule("cmpl-1", PROMPT, WORKERS).worker_id
    a.send_to(b)
    return worker


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_remote_booking_steers_the_next_request_to_another_worker(clock: FakeClock) -> None:
    a, b = met(clock)
    first = a.scheduler.schedule("cmpl-1", PROMPT, WORKERS)
    a.send_to(b)
    assert b.active(first.worker_id) == a.active(first.worker_id) == (1, 4)
    # The same prompt from b: the remote request pins its prefix there, so b follows it.
    same = b.scheduler.schedule("cmpl-2", PROMPT, WORKERS)
    assert same.worker_id == first.worker_id
    # A different prompt from b goes to the idle worker, which b alone would not know.
    other = b.scheduler.schedule("cmpl-3", list(range(5000, 5000 + 4 * B)), WORKERS)
    assert other.worker_id != first.worker_id


def test_prefill_and_free_of_a_remote_request_apply(clock: FakeClock) -> None:
    a, b = met(clock)
    worker = a.scheduler.schedule("cmpl-1", PROMPT, WORKERS).worker_id
    a.scheduler.mark_prefill_completed("cmpl-1", 1)
    a.send_to(b)
    state = b.scheduler.sequences.get(worker).get(remote_key("a", "cmpl-1"))
    assert state is not None and not state.prefill_pending and state.context_len == 4 * B + 1
    a.scheduler.free("cmpl-1")
    a.send_to(b)
    assert b.active(worker) == (0, 0)
    assert b.books.replicas() == {"a": 0}


def test_own_messages_change_nothing(clock: FakeClock) -> None:
    a, _ = met(clock)
    a.scheduler.schedule("cmpl-1", PROMPT, WORKERS)
    echoed = a.outbox[0]
    assert a.books.receive(a.message(echoed)) == []
    assert a.books.receive(a.message(SnapshotRequest())) == []
    assert sum(a.active(w)[0] for w in WORKERS) == 1
    assert a.books.replicas() == {"b": 0}


def test_equal_request_ids_of_two_replicas_do_not_collide(clock: FakeClock) -> None:
    a, b = met(clock)
    a.scheduler.schedule("cmpl-1", PROMPT, WORKERS)
    a.send_to(b)
    b.scheduler.schedule("cmpl-1", PROMPT, WORKERS)
    assert sum(b.active(w)[0] for w in WORKERS) == 2
    b.scheduler.free("cmpl-1")  # b's own request; a's stays
    assert sum(b.active(w)[0] for w in WORKERS) == 1


def test_a_replica_that_stops_beating_loses_its_bookings(clock: FakeClock) -> None:
    a, b = met(clock)
    worker = booked_on_both(a, b)
    for _ in range(5):  # beating: kept
        clock.now += 1.0
        b.books.receive(a.message(a.books.heartbeat()))
        assert b.books.expire() == []
    assert b.active(worker) == (1, 4)
    clock.now += 3.0  # exactly miss_limit intervals silent: not yet
    assert b.books.expire() == []
    clock.now += 0.1
    assert b.books.expire() == ["a"]
    assert b.active(worker) == (0, 0) and b.books.replicas() == {}
    assert b.books.stats.replicas_expired == 1


def test_a_leaving_replica_is_dropped_at_once(clock: FakeClock) -> None:
    a, b = met(clock)
    worker = booked_on_both(a, b)
    assert b.books.receive(a.message(ReplicaLeaving())) == []
    assert b.active(worker) == (0, 0) and b.books.replicas() == {}


def test_a_late_replica_starts_with_the_others_bookings(clock: FakeClock) -> None:
    a = Replica("a", clock)
    w1 = a.scheduler.schedule("cmpl-1", PROMPT, WORKERS).worker_id
    w2 = a.scheduler.schedule("cmpl-2", list(range(7000, 7000 + 2 * B + 3)), WORKERS).worker_id
    a.scheduler.mark_prefill_completed("cmpl-1", 2)
    assert a.outbox == []  # alone: nothing published
    b = Replica("b", clock)
    answers = a.books.receive(b.message(b.books.hello()))
    assert [type(x) for x in answers] == [BookingSnapshot]
    for answer in answers:
        assert b.books.receive(a.message(answer)) == []
    assert b.books.replicas() == {"a": 2}
    assert {w: b.active(w) for w in WORKERS} == {w: a.active(w) for w in WORKERS}
    state = b.scheduler.sequences.get(w1).get(remote_key("a", "cmpl-1"))
    assert state is not None and not state.prefill_pending and state.context_len == 4 * B + 2
    assert b.scheduler.sequences.get(w2).get(remote_key("a", "cmpl-2")).prefill_pending
    # a heard b's hello: from now on its changes are published.
    a.scheduler.free("cmpl-2")
    a.send_to(b)
    assert b.books.replicas() == {"a": 1}


def test_a_disagreeing_heartbeat_repairs_the_books(clock: FakeClock) -> None:
    a, b = met(clock)
    a.scheduler.schedule("cmpl-1", PROMPT, WORKERS)
    a.scheduler.schedule("cmpl-2", list(range(9000, 9000 + 3 * B)), WORKERS)
    a.scheduler.free("cmpl-1")
    lost_free = a.outbox.pop()  # the free of cmpl-1 never arrives
    assert isinstance(lost_free, BookingChanges)
    a.send_to(b)
    assert b.books.replicas() == {"a": 2}
    answers = b.books.receive(a.message(a.books.heartbeat()))
    assert answers == [SnapshotRequest("a")]
    assert b.books.receive(a.message(a.books.heartbeat())) == []  # asked once per interval
    for request in answers:
        for snapshot in a.books.receive(b.message(request)):
            b.books.receive(a.message(snapshot))
    assert b.books.replicas() == {"a": 1}
    assert sum(b.active(w)[0] for w in WORKERS) == 1
    assert b.books.receive(a.message(a.books.heartbeat())) == []
    assert b.books.stats.resyncs == 1


def test_a_worker_leaving_releases_remote_and_own_bookings(clock: FakeClock) -> None:
    a, b = met(clock)
    worker = booked_on_both(a, b)
    a.scheduler.remove_worker(worker)
    b.scheduler.remove_worker(worker)
    assert b.outbox == []  # a remote key is not b's to announce
    a.send_to(b)  # a announces its own request as freed
    assert a.books.heartbeat() == ReplicaHeartbeat(1.0, 0, 0)
    assert b.books.replicas() == {"a": 0}
    assert b.books.receive(a.message(a.books.heartbeat())) == []


def test_a_booking_in_another_block_size_is_rejected(clock: FakeClock) -> None:
    b = Replica("b", clock)
    booking = SequenceBooked("cmpl-1", 1, block_size=32, prompt_len=64, block_hashes=[1, 2])
    b.books.receive(ReplicaSyncMessage("a", BookingChanges([booking])))
    assert b.active(1) == (0, 0) and b.books.stats.rejected == 1
    bad = SequenceBooked("cmpl-2", 1, block_size=B, prompt_len=64, block_hashes=[1])
    b.books.receive(ReplicaSyncMessage("a", BookingChanges([bad])))
    assert b.active(1) == (0, 0) and b.books.stats.rejected == 2


# --------------------------------------------------------------------------- untrusted peers


@pytest.mark.parametrize(
    "data",
    [
        ReplicaHeartbeat(float("inf"), 0, 0),
        ReplicaHeartbeat(float("nan"), 0, 0),
        ReplicaHeartbeat(3600.0, 0, 0),
        ReplicaHeartbeat(-1.0, 0, 0),
        ReplicaHeartbeat(1.0, -5, 0),
        ReplicaHeartbeat(1.0, 0, 2**40),
        BookingChanges([SequenceBooked("cmpl-1", 1, B, prompt_len=-1)]),
        BookingChanges([SequenceBooked("cmpl-1", -1, B, prompt_len=64)]),
        BookingChanges([SequenceBooked("cmpl-1", 1, 0, prompt_len=64)]),
        BookingChanges([SequenceBooked("x" * 10_000, 1, B, prompt_len=64)]),
        BookingChanges([SequenceBooked("cmpl-1", 1, B, 64, num_speculative_tokens=10**6)]),
        BookingChanges([SequencePrefilled("cmpl-1", new_tokens=-3)]),
        BookingChanges([SequenceFreed("")]),
    ],
    ids=[
        "interval_inf", "interval_nan", "interval_hour", "interval_negative", "bookings",
        "fingerprint", "prompt_len", "worker_id", "block_size", "request_id", "speculative",
        "prefilled", "empty_id",
    ],
)  # fmt: skip
def test_a_peer_message_out_of_bounds_fails_to_decode(data: ReplicaSyncData) -> None:
    """Every number a peer sends is bounded by the wire type: an infinite heartbeat
    interval (a replica that never expires) or a negative count never reaches the books."""
    with pytest.raises(msgspec.ValidationError):
        decode(encode(ReplicaSyncMessage("a", data)), ReplicaSyncMessage)
    with pytest.raises(msgspec.ValidationError):
        decode(encode(ReplicaSyncMessage("x" * 10_000, ReplicaLeaving())), ReplicaSyncMessage)


def test_a_booking_on_an_unknown_worker_creates_no_worker_and_heals_by_snapshot(
    clock: FakeClock,
) -> None:
    a, b = Replica("a", clock), Replica("b", clock)
    a.scheduler.update_worker(KvWorkerSpec(3, B))  # a knows worker 3, b not yet
    meet(a, b)
    a.scheduler.schedule("cmpl-1", PROMPT, [3])
    a.send_to(b)
    assert b.scheduler.sequences.get(3) is None, "no ghost worker"
    assert b.books.replicas() == {"a": 0} and b.books.stats.unknown_worker == 1
    b.scheduler.update_worker(KvWorkerSpec(3, B))  # the card arrives
    clock.now += 1.0
    answers = b.books.receive(a.message(a.books.heartbeat()))
    assert answers == [SnapshotRequest("a")]
    for request in answers:
        for snapshot in a.books.receive(b.message(request)):
            b.books.receive(a.message(snapshot))
    assert b.active(3) == (1, 4) and b.books.replicas() == {"a": 1}


def test_made_up_worker_ids_never_become_workers(clock: FakeClock) -> None:
    b = Replica("b", clock)
    bookings = [SequenceBooked(f"cmpl-{i}", 10_000 + i, B, 64, [i, i + 1]) for i in range(100)]
    b.books.receive(ReplicaSyncMessage("a", BookingChanges(bookings)))
    assert set(b.scheduler.sequences.loads()) <= set(WORKERS)
    assert b.books.stats.unknown_worker == 100 and b.books.replicas() == {"a": 0}


def test_an_overlap_beyond_the_hashes_is_rejected(clock: FakeClock) -> None:
    b = Replica("b", clock)
    bad = SequenceBooked("cmpl-1", 1, B, 2 * B, [1, 2], overlap_blocks=5, cached_blocks=1)
    b.books.receive(ReplicaSyncMessage("a", BookingChanges([bad])))
    assert b.active(1) == (0, 0) and b.books.stats.rejected == 1


def test_peers_and_their_bookings_are_bounded(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_books, "MAX_PEERS", 2)
    monkeypatch.setattr(replica_books, "MAX_REMOTE_BOOKINGS", 3)
    b = Replica("b", clock)
    for replica in ("p1", "p2", "p3"):
        b.books.receive(ReplicaSyncMessage(replica, ReplicaHeartbeat(1.0, 0, 0)))
    assert sorted(b.books.replicas()) == ["p1", "p2"] and b.books.stats.peers_ignored == 1
    bookings = [SequenceBooked(f"cmpl-{i}", 1, B, B, [i]) for i in range(5)]
    b.books.receive(ReplicaSyncMessage("p1", BookingChanges(bookings)))
    assert b.books.replicas()["p1"] == 3 and b.active(1)[0] == 3
    assert b.books.stats.rejected == 2


def test_a_replica_refuses_an_interval_its_peers_would_refuse(clock: FakeClock) -> None:
    scheduler = KvScheduler(B, rng=random.Random(0), clock=clock)
    for interval in (0.0, 61.0, float("inf")):
        with pytest.raises(ValueError, match="interval_s"):
            ReplicaBooks(scheduler, "a", interval_s=interval, clock=clock)


# --------------------------------------------------------------------------- over a bus


class MemoryBus:
    """Core pub/sub in memory: every subscriber of a subject gets every message."""

    def __init__(self) -> None:
        self.subscribers: list[tuple[str, Callable[[Any], Awaitable[None]]]] = []
        self.published: list[ReplicaSyncMessage] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append(decode(data, ReplicaSyncMessage))
        for wanted, callback in list(self.subscribers):
            if wanted == subject:
                await callback(SimpleNamespace(subject=subject, data=data))

    async def subscribe(
        self, subject: str, callback: Callable[[Any], Awaitable[None]], queue: str = ""
    ) -> Any:
        entry = (subject, callback)
        self.subscribers.append(entry)

        async def unsubscribe() -> None:
            self.subscribers.remove(entry)

        return SimpleNamespace(unsubscribe=unsubscribe)


def changes_of(messages: list[ReplicaSyncMessage], replica_id: str) -> list[list[str]]:
    return [
        [type(c).__name__ for c in m.data.changes]
        for m in messages
        if m.replica_id == replica_id and isinstance(m.data, BookingChanges)
    ]


async def test_over_a_bus_a_burst_is_one_message_and_both_books_agree() -> None:
    bus = MemoryBus()
    schedulers = [KvScheduler(B, rng=random.Random(i)) for i in range(2)]
    for scheduler in schedulers:
        for worker in WORKERS:
            scheduler.update_worker(KvWorkerSpec(worker, B))
    settings = ReplicaSyncSettings(interval_s=0.05)
    syncs = [
        await RouterReplicaSync(bus, s, "subj", settings, replica_id=f"r{i}").start()
        for i, s in enumerate(schedulers)
    ]
    try:
        await asyncio.sleep(0.01)
        assert syncs[0].books.replicas() == {"r1": 0}
        assert syncs[1].books.replicas() == {"r0": 0}
        for i in range(4):
            schedulers[0].schedule(f"cmpl-{i}", [*PROMPT, i], WORKERS)
        schedulers[0].mark_prefill_completed("cmpl-0", 1)
        schedulers[0].free("cmpl-3")
        await asyncio.sleep(0.01)
        assert changes_of(bus.published, "r0") == [
            ["SequenceBooked"] * 4 + ["SequencePrefilled", "SequenceFreed"]
        ]
        mine, theirs = (s.sequences.loads() for s in schedulers)
        assert {w: load for w, load in mine.items() if load.active_requests} == theirs
        await asyncio.sleep(0.12)  # heartbeats agree: no snapshot asked for
        assert syncs[1].books.stats.resyncs == 0
        state = syncs[1].debug_state()
        assert state["replicas"] == {"r0": 3} and state["malformed"] == 0
    finally:
        await syncs[0].close()
    assert syncs[1].books.replicas() == {}  # r0 said goodbye
    assert all(load.active_requests == 0 for load in schedulers[1].sequences.loads().values())
    await syncs[1].close()
    assert bus.subscribers == []


def test_wire_messages_round_trip() -> None:
    message = ReplicaSyncMessage(
        "r0",
        BookingChanges(
            [
                SequenceBooked("cmpl-1", 7, B, 40, [1, 2], overlap_blocks=1, cached_blocks=1),
                SequencePrefilled("cmpl-1", 1),
                SequenceFreed("cmpl-1"),
            ]
        ),
    )
    assert decode(encode(message), ReplicaSyncMessage) == message
