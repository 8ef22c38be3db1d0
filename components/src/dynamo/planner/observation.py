"""What the planner saw over one interval: the traffic through the frontends and the load
each pool's workers report. Plain values, no transport: `frontend_scrape.py` and
`worker_load.py` fill them, `forecast.py`, `perf_model.py` and `policy.py` read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo.planner.pools import PoolRole


@dataclass(frozen=True)
class TrafficWindow:
    """The frontends' traffic for one model over `seconds` (deltas of their counters and
    histograms between two scrapes, summed over every frontend). A field is None when the
    window had nothing to measure it from (no finished request, no speculative step)."""

    seconds: float
    requests: int = 0  # requests that ended in the window, any status
    mean_isl: float | None = None  # prompt tokens per request
    mean_osl: float | None = None  # generated tokens per request
    ttft_mean_s: float | None = None
    ttft_p90_s: float | None = None  # from the histogram's buckets, interpolated
    itl_mean_s: float | None = None
    itl_p90_s: float | None = None
    # Tokens per verification step, (drafts + accepted) / drafts of the spec counters.
    acceptance_length: float | None = None
    # Requests in flight at the window's end minus at its start (the frontends' gauge).
    inflight_change: int = 0

    @property
    def request_rate(self) -> float:
        """Requests that ended, per second."""
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def arrival_rate(self) -> float:
        """Requests that arrived, per second: those that ended plus the growth of those in
        flight. Under overload the ended ones are capped by what the workers serve, and
        only this says how far demand went past it."""
        if self.seconds <= 0:
            return 0.0
        return max(0.0, (self.requests + self.inflight_change) / self.seconds)


@dataclass(frozen=True)
class PoolLoad:
    """The latest load reports of one pool's live workers (stale reports left out)."""

    workers: int = 0  # workers that reported
    active_requests: int = 0  # summed over the workers
    waiting_requests: int = 0
    mean_kv_usage: float = 0.0  # 0..1
    total_blocks: int = 0  # KV blocks of one worker (the smallest reported), 0 unknown
    k_in_force: int | None = None  # draft tokens per step most workers run; None: no speculation
    # Sum of squared running batches over their sum: the batch a generated token saw.
    token_weighted_batch: float = 0.0

    @property
    def mean_active(self) -> float:
        """Requests per worker."""
        return self.active_requests / self.workers if self.workers else 0.0


@dataclass(frozen=True)
class Observation:
    """One interval: the traffic and every pool's load."""

    traffic: TrafficWindow
    pools: dict[PoolRole, PoolLoad] = field(default_factory=dict)
