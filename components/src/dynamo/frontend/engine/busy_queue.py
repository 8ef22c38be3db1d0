"""Requests that find every worker busy wait here for room instead of failing at once.

The KV router judges a worker busy past `--busy-kv-usage` or `--busy-waiting-requests`
and refuses a request when all are (`AllWorkersBusyError`). Without a queue that request
is answered 503 at once, and a burst of a few seconds turns into a burst of errors that
every client retries at the same moment. With one (`--busy-queue-size` > 0), the request
joins its endpoint's `BusyQueue`:

* **bounded**: a full queue answers 503 at once (`BusyQueueFullError`), so memory and
  wait stay bounded under any load;
* **ordered** by the request's `priority` (vLLM's field: lower is served sooner, default
  0), first come first served within one priority. Only the head asks the router again;
  a request arriving while others wait queues behind them even when the router would take
  it, so a newcomer never takes the room an earlier request waits for;
* **deadline**: a request that waited `--busy-queue-timeout` seconds leaves with a 503
  (`BusyQueueTimeoutError`); a client that goes away leaves at once (its task is
  cancelled and its place freed).

The head asks again every `poll_s` seconds, jittered by +-50%. Polling rather than a wake-up
on the end of one of this frontend's own requests is deliberate: room also appears through
the workers' load reports and through requests of other frontend replicas ending, which
this frontend only sees through its books. A wake-up on local ends would let the replica
whose requests end first take every freed place while another replica's queue starves;
with the same jittered cadence on every replica, each head has the same chance at each
freed place, whichever replica's request freed it. The cost on one replica is a place
idle for half a poll interval on average (10 ms at the default 20 ms).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar

from dynamo.frontend.engine.errors import EngineOverloadedError
from dynamo.llm.router import AllWorkersBusyError

T = TypeVar("T")

DEFAULT_BUSY_QUEUE_SIZE = 1024
"""Requests one endpoint holds while its workers are busy (beyond: 503 at once). As many
as the frontend's `--max-inflight` admits a model, which bounds queued and running
requests together: with the defaults, the admission bound is the one that binds."""
DEFAULT_BUSY_QUEUE_TIMEOUT_S = 30.0
"""Longest a request waits for room before its 503."""
DEFAULT_BUSY_QUEUE_POLL_S = 0.02
"""How often the head of the queue asks the router again."""


class QueueOutcome(StrEnum):
    """How a request left the queue (the `outcome` label of the queue metrics)."""

    ADMITTED = "admitted"  # a worker took it
    TIMED_OUT = "timed_out"  # its wait passed the deadline: 503
    CANCELLED = "cancelled"  # the client went away, or the request failed otherwise


class BusyQueueError(EngineOverloadedError):
    """The busy queue gave up on a request: 503, with `reason` for the client."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BusyQueueFullError(BusyQueueError):
    """Every worker is busy and the queue holds its bound of requests: 503 at once."""


class BusyQueueTimeoutError(BusyQueueError):
    """Every worker stayed busy for the request's whole wait: 503."""


class QueueObserver(Protocol):
    """Told about every request that enters or leaves a queue (the frontend's metrics)."""

    def queue_entered(self, model: str) -> None:
        """A request joined the queue."""

    def queue_left(self, model: str, outcome: QueueOutcome, waited_s: float) -> None:
        """A request that had joined left it (admitted, timed out or cancelled)."""

    def queue_rejected(self, model: str) -> None:
        """A request found the queue full and never joined it."""


@dataclass(frozen=True)
class BusyQueueSettings:
    """The bound, deadline and polling cadence of each endpoint's queue."""

    size: int = DEFAULT_BUSY_QUEUE_SIZE  # 0: no queue, a 503 as soon as all are busy
    timeout_s: float = DEFAULT_BUSY_QUEUE_TIMEOUT_S
    poll_s: float = DEFAULT_BUSY_QUEUE_POLL_S

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"busy queue size must be >= 0, got {self.size}")
        if self.timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError("busy queue timeout and poll interval must be > 0")

    @property
    def enabled(self) -> bool:
        return self.size > 0


@dataclass(order=True)
class _Waiter:
    priority: int
    arrival: int
    turn: asyncio.Event = field(compare=False, default_factory=asyncio.Event)
    gone: bool = field(compare=False, default=False)


@dataclass(eq=False)
class BusyQueue:
    """One endpoint's waiting requests, in (priority, arrival) order."""

    settings: BusyQueueSettings
    observer: QueueObserver | None = None
    rng: random.Random = field(default_factory=random.Random)
    _heap: list[_Waiter] = field(init=False, default_factory=list)
    _arrivals: itertools.count[int] = field(init=False, default_factory=itertools.count)
    _depth: int = field(init=False, default=0)

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return self._depth

    async def wait_for_room(
        self, model: str, priority: int, attempt: Callable[[], Awaitable[T]]
    ) -> T:
        """Call `attempt` in this request's turn until it stops raising
        `AllWorkersBusyError`, and return what it returned. Raises `BusyQueueFullError` at
        once when the queue is full and `BusyQueueTimeoutError` past the deadline; any
        other exception of `attempt` ends the wait and propagates."""
        if self._depth >= self.settings.size:
            if self.observer is not None:
                self.observer.queue_rejected(model)
            raise BusyQueueFullError(
                f"every worker is busy and {self._depth} requests already wait"
            )
        waiter = _Waiter(priority, next(self._arrivals))
        heapq.heappush(self._heap, waiter)
        self._depth += 1
        if self.observer is not None:
            self.observer.queue_entered(model)
        self._wake_head()
        started = time.monotonic()
        outcome = QueueOutcome.CANCELLED
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                result = await self._take_turns(waiter, attempt)
            outcome = QueueOutcome.ADMITTED
            return result
        except TimeoutError:
            outcome = QueueOutcome.TIMED_OUT
            raise BusyQueueTimeoutError(
                f"every worker stayed busy for the {self.settings.timeout_s:g} s the request "
                "may wait"
            ) from None
        finally:
            waiter.gone = True
            self._depth -= 1
            self._wake_head()
            if self.observer is not None:
                self.observer.queue_left(model, outcome, time.monotonic() - started)

    async def _take_turns(self, waiter: _Waiter, attempt: Callable[[], Awaitable[T]]) -> T:
        while True:
            await waiter.turn.wait()
            if self._head() is not waiter:  # a request of higher priority came first
                waiter.turn.clear()
                continue
            try:
                return await attempt()
            except AllWorkersBusyError:
                await asyncio.sleep(self.settings.poll_s * self.rng.uniform(0.5, 1.5))

    def _head(self) -> _Waiter | None:
        while self._heap and self._heap[0].gone:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def _wake_head(self) -> None:
        head = self._head()
        if head is not None:
            head.turn.set()
