"""A clock that only moves when the test moves it.

Time-based bookkeeping (backoff of card retries, the TTL of load reports, the grace of a
departed worker, publishing intervals) takes its clock as a `Callable[[], float]`
(`time.monotonic` by default). Tests inject a `FakeClock` instead, so they step time
exactly and instantly rather than sleeping and hoping the scheduler was on time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FakeClock:
    """Returns `now` when called. Starts away from zero so that "no time yet" and
    "time zero" cannot be confused by the code under test; a test moves time by setting
    `now`."""

    now: float = 100.0

    def __call__(self) -> float:
        return self.now
