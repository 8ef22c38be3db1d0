"""When a worker is too busy to be sent more work (`--busy-kv-usage`,
`--busy-waiting-requests`).

A worker whose KV cache is nearly full preempts and recomputes requests; one with a deep
waiting queue adds its whole queue to every new request's time to first token. Sending it
more only makes that worse, and when every worker is in that state the honest answer is
503 with `Retry-After` (a client or a load balancer retries later or elsewhere) rather than
an ever longer queue.

The judgement uses what the KV router already has: each worker's own load report
(`LoadMetrics`, several per second), and its own books (a burst placed between two
reports is counted before the worker reports it): the blocks booked there, and the
requests booked there beyond the `max_num_seqs` its card says it runs at once, which must
be waiting. Without the latter a queue of requests waiting for room drained into a
worker that looked idle until its next report (tens of requests in a few milliseconds). A worker without a
recent report is never busy: its load is unknown, and refusing work on a guess would
turn a late report into an outage. Both thresholds are off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamo.llm.protocols import LoadMetrics


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    """A worker is busy when its KV cache is at least `kv_usage` full (a fraction, 0 to 1),
    or at least `waiting_requests` requests wait in its queue. None disables a check."""

    kv_usage: float | None = None
    waiting_requests: int | None = None

    def __post_init__(self) -> None:
        if self.kv_usage is not None and not 0.0 < self.kv_usage <= 1.0:
            raise ValueError(f"busy kv_usage must be in (0, 1], got {self.kv_usage}")
        if self.waiting_requests is not None and self.waiting_requests < 1:
            raise ValueError(f"busy waiting_requests must be >= 1, got {self.waiting_requests}")

    @property
    def enabled(self) -> bool:
        return self.kv_usage is not None or self.waiting_requests is not None

    def busy_reason(
        self, load: LoadMetrics, booked_blocks: int = 0, booked_waiting: int = 0
    ) -> str | None:
        """Why a worker reporting `load`, with `booked_blocks` booked there by the router
        and `booked_waiting` of the requests it booked there beyond what the worker runs
        at once (`max_num_seqs`), is busy; None when it is not."""
        if self.kv_usage is not None:
            usage = load.kv_usage
            if load.total_blocks > 0:
                usage = max(usage, booked_blocks / load.total_blocks)
            if usage >= self.kv_usage:
                return f"KV cache {usage:.0%} full"
        waiting = max(load.waiting_requests, booked_waiting)
        if self.waiting_requests is not None and waiting >= self.waiting_requests:
            return f"{waiting} requests waiting"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"kv_usage": self.kv_usage, "waiting_requests": self.waiting_requests}
