"""The busy queue: bounded, (priority, arrival) order, deadline, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from dynamo.frontend.engine.busy_queue import (
    BusyQueue,
    BusyQueueFullError,
    BusyQueueSettings,
    BusyQueueTimeoutError,
    QueueOutcome,
)
from dynamo.llm.router import AllWorkersBusyError

MODEL = "m"


@dataclass
class Room:
    """The workers' room as the router sees it: `free` places; every attempt is logged."""

    free: int = 0
    admitted: list[str] = field(default_factory=list)
    attempts: list[str] = field(default_factory=list)

    def attempt(self, name: str) -> Callable[[], Awaitable[str]]:
        async def select() -> str:
            self.attempts.append(name)
            if self.free <= 0:
                raise AllWorkersBusyError("all busy")
            self.free -= 1
            self.admitted.append(name)
            return name

        return select


@dataclass
class Observed:
    entered: int = 0
    left: list[tuple[QueueOutcome, float]] = field(default_factory=list)
    rejected: int = 0

    def queue_entered(self, model: str) -> None:
        self.entered += 1

    def queue_left(self, model: str, outcome: QueueOutcome, waited_s: float) -> None:
        self.left.append((outcome, waited_s))

    def queue_rejected(self, model: str) -> None:
        self.rejected += 1


def make_queue(size: int = 8, timeout_s: float = 10.0) -> tuple[BusyQueue, Observed]:
    observed = Observed()
    return BusyQueue(BusyQueueSettings(size, timeout_s, poll_s=0.002), observed), observed


async def enqueue(queue: BusyQueue, room: Room, name: str, priority: int = 0) -> asyncio.Task[str]:
    """Start a waiter and let it join the queue (it joins before its first await)."""
    task = asyncio.ensure_future(queue.wait_for_room(MODEL, priority, room.attempt(name)))
    depth = queue.depth
    await asyncio.sleep(0)
    assert queue.depth == depth + 1, f"{name} did not join"
    return task


async def test_room_at_once_admits_without_waiting() -> None:
    queue, observed = make_queue()
    room = Room(free=1)
    assert await queue.wait_for_room(MODEL, 0, room.attempt("a")) == "a"
    assert queue.depth == 0
    assert observed.entered == 1 and [o for o, _ in observed.left] == [QueueOutcome.ADMITTED]


async def test_first_come_first_served_within_a_priority() -> None:
    queue, _ = make_queue()
    room = Room()
    tasks = [await enqueue(queue, room, name) for name in "abcd"]
    await asyncio.sleep(0.02)  # the head asks again and again; nobody else asks
    assert set(room.attempts) == {"a"}
    room.free = 4
    assert await asyncio.gather(*tasks) == list("abcd")
    assert room.admitted == list("abcd")


async def test_a_lower_priority_value_is_served_first() -> None:
    queue, _ = make_queue()
    room = Room()
    tasks = [await enqueue(queue, room, "low-1", 5), await enqueue(queue, room, "low-2", 5)]
    tasks.append(await enqueue(queue, room, "urgent", -1))
    tasks.append(await enqueue(queue, room, "default", 0))
    room.free = 4
    await asyncio.gather(*tasks)
    assert room.admitted == ["urgent", "default", "low-1", "low-2"]


async def test_a_full_queue_answers_at_once_and_counts_the_refusal() -> None:
    queue, observed = make_queue(size=2)
    room = Room()
    tasks = [await enqueue(queue, room, "a"), await enqueue(queue, room, "b")]
    with pytest.raises(BusyQueueFullError, match="2 requests already wait"):
        await queue.wait_for_room(MODEL, 0, room.attempt("c"))
    assert observed.rejected == 1 and queue.depth == 2
    room.free = 2
    assert await asyncio.gather(*tasks) == ["a", "b"]


async def test_a_wait_past_the_deadline_ends_with_the_timeout_error() -> None:
    queue, observed = make_queue(timeout_s=0.05)
    room = Room()
    with pytest.raises(BusyQueueTimeoutError, match=r"0\.05 s"):
        await queue.wait_for_room(MODEL, 0, room.attempt("a"))
    assert queue.depth == 0
    ((outcome, waited),) = observed.left
    assert outcome is QueueOutcome.TIMED_OUT and waited >= 0.05


async def test_a_cancelled_waiter_leaves_and_the_next_one_gets_the_room() -> None:
    queue, observed = make_queue()
    room = Room()
    first = await enqueue(queue, room, "gone")
    second = await enqueue(queue, room, "kept")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert queue.depth == 1
    room.free = 1
    assert await second == "kept"
    assert [o for o, _ in observed.left] == [QueueOutcome.CANCELLED, QueueOutcome.ADMITTED]


async def test_another_error_of_the_attempt_ends_the_wait_and_frees_the_place() -> None:
    queue, _ = make_queue()

    async def no_workers_left() -> str:
        raise LookupError("no instances")

    with pytest.raises(LookupError):
        await queue.wait_for_room(MODEL, 0, no_workers_left)
    assert queue.depth == 0


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        BusyQueueSettings(size=-1)
    with pytest.raises(ValueError, match="> 0"):
        BusyQueueSettings(timeout_s=0)
    assert not BusyQueueSettings(size=0).enabled
