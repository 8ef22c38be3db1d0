"""Which workers' KV events a router should believe, given who is alive.

Events arrive from a replayable stream, so a router hears about workers in three states:

* **live**: in the endpoint's set of ready instances; their events apply;
* **departed**: were live and left (lease expired, deregistered, draining). Their blocks
  are dropped at once, and their late or replayed events are ignored so they cannot come
  back, until the worker shows up live again;
* **unconfirmed**: never seen live by this router. Either a worker whose instance record
  has not reached us yet (its events raced ahead), or a dead worker whose history the
  stream still holds (a frontend started after it died). Their events apply, and if they
  are still not live after `grace_s` they are treated as departed.

Pure bookkeeping with an injected clock; the NATS feed calls it and acts on the answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

DEFAULT_GRACE_S = 10.0


class WorkerMembership:
    """Tracks live / departed / unconfirmed workers for one router."""

    def __init__(
        self, grace_s: float = DEFAULT_GRACE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self._live: set[int] = set()
        self._departed: set[int] = set()
        self._unconfirmed: dict[int, float] = {}  # worker id -> first event time

    @property
    def live(self) -> frozenset[int]:
        return frozenset(self._live)

    def set_live(self, worker_ids: Iterable[int]) -> list[int]:
        """The ready instances changed; returns the workers that just left."""
        live = set(worker_ids)
        left = sorted(self._live - live)
        self._departed.update(left)
        self._departed.difference_update(live)
        for worker_id in live:
            self._unconfirmed.pop(worker_id, None)
        self._live = live
        return left

    def accepts(self, worker_id: int) -> bool:
        """Whether an event or report of `worker_id` should be applied."""
        if worker_id in self._live:
            return True
        if worker_id in self._departed:
            return False
        self._unconfirmed.setdefault(worker_id, self._clock())
        return True

    def expire(self) -> list[int]:
        """Unconfirmed workers past the grace period, now departed (drop their blocks)."""
        cutoff = self._clock() - self.grace_s
        gone = sorted(w for w, first in self._unconfirmed.items() if first <= cutoff)
        for worker_id in gone:
            del self._unconfirmed[worker_id]
            self._departed.add(worker_id)
        return gone
