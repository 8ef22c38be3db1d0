"""The workers' `LoadMetrics` over NATS → each pool's `PoolLoad`.

Every worker already publishes its load for the KV routers, on core NATS
(`subjects.load_metrics_subject`), as a msgpack `LoadMetrics`. `WorkerLoadWatcher`
listens to the same subjects, per pool component, and keeps each worker's latest report
with the time it arrived; `load(role)` folds the fresh ones into a `PoolLoad`.

Liveness is the reports' age, nothing else. `LoadPublisher` (`kv_router.publisher`)
reports on every change and also at least every `DEFAULT_LOAD_INTERVAL_S` (1 s) as a
heartbeat, so an idle live worker keeps re-reporting an unchanged load and is never aged
out. A worker that leaves, gracefully or not, publishes nothing more (its publisher just
stops; no goodbye is sent or deleted), so it drops out `stale_after_s` after its last
report. The default, `DEFAULT_STALE_AFTER_S`, is the KV routers' own load TTL (five
heartbeats): long enough that a heartbeat delayed by a busy event loop or a NATS
reconnect does not make a live worker vanish from the count for one interval, short
against the planner's interval (tens of seconds), so a departed worker is gone by the
next decision. The runtime's instance registry would tell departure sooner, but the
planner only sizes pools from interval to interval, and the reports alone keep this
module to one subscription per pool with nothing else to keep consistent. A worker told
to stop (`ServedWorker.stop`) stops its load publisher before it drains, so a draining
worker's requests leave the pool's load `stale_after_s` after SIGTERM even while it
still finishes them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dynamo.llm.kv_router.scheduler_defaults import DEFAULT_LOAD_METRICS_TTL_S
from dynamo.llm.kv_router.subjects import instance_of_subject, load_metrics_filter
from dynamo.llm.protocols import LoadMetrics, decode
from dynamo.planner.observation import PoolLoad
from dynamo.planner.pools import PoolRole

log = logging.getLogger(__name__)

DEFAULT_STALE_AFTER_S = DEFAULT_LOAD_METRICS_TTL_S
"""Reports older than this are left out (the worker is gone or stalled)."""

Clock = Callable[[], float]
"""Monotonic seconds; only differences between two readings matter."""


@dataclass(frozen=True)
class Report:
    """A worker's latest load report and when it arrived (by the watcher's clock)."""

    metrics: LoadMetrics
    received_at: float


@dataclass(slots=True)
class WatcherStats:
    """What reached the watcher (logs, tests)."""

    reports: int = 0
    malformed: int = 0  # undecodable, or its worker id not the one its subject names


def pool_load(reports: list[LoadMetrics]) -> PoolLoad:
    """One pool's load from its live workers' latest reports.

    `total_blocks` is the smallest positive one (the worker that fills up first bounds
    what a request may need); `k_in_force` the K most workers run, ties going to the
    larger K so the answer does not depend on the order reports arrived in;
    `token_weighted_batch` the batch a generated token saw on average (a worker running
    `b` requests emits `b` times the tokens of one running one, so the frontends' mean
    ITL is a mean over workers weighted by `b`: `sum(b^2) / sum(b)`)."""
    if not reports:
        return PoolLoad()
    blocks = [m.total_blocks for m in reports if m.total_blocks > 0]
    ks = collections.Counter(
        m.num_speculative_tokens for m in reports if m.num_speculative_tokens is not None
    )
    running = sum(m.active_requests for m in reports)
    squares = sum(m.active_requests**2 for m in reports)
    return PoolLoad(
        workers=len(reports),
        active_requests=sum(m.active_requests for m in reports),
        waiting_requests=sum(m.waiting_requests for m in reports),
        mean_kv_usage=statistics.fmean(m.kv_usage for m in reports),
        total_blocks=min(blocks, default=0),
        k_in_force=max(ks, key=lambda k: (ks[k], k)) if ks else None,
        token_weighted_batch=squares / running if running else 0.0,
    )


class WorkerLoadWatcher:
    """Follows the load reports of every pool's workers (one component per pool; pools
    sharing a component share its reports)."""

    def __init__(
        self,
        nc: NatsClient,
        namespace: str,
        components: Mapping[PoolRole, str],
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        if stale_after_s <= 0:
            raise ValueError("stale_after_s must be positive")
        self._nc = nc
        self._components = dict(components)
        # Checks the names now (a bad one raises here, not in `start`).
        self._filters = {c: load_metrics_filter(namespace, c) for c in set(components.values())}
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._latest: dict[str, dict[int, Report]] = {c: {} for c in self._filters}
        self._subs: list[Subscription] = []
        self.stats = WatcherStats()

    async def start(self) -> None:
        """Subscribe to every pool component's load subjects; once this returns the
        server has the subscriptions, so every report published from then on arrives."""
        if self._subs:
            raise RuntimeError("worker load watcher already started")
        for component, subject in self._filters.items():
            self._subs.append(await self._nc.subscribe(subject, cb=self._receiver(component)))
        await self._nc.flush()

    async def close(self) -> None:
        """Unsubscribe (idempotent; a closed connection has nothing left to undo)."""
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def load(self, role: PoolRole) -> PoolLoad:
        """The pool's load from its workers' reports younger than `stale_after_s`
        (older ones are forgotten here)."""
        latest = self._latest[self._components[role]]
        oldest = self._clock() - self.stale_after_s
        for worker_id in [w for w, r in latest.items() if r.received_at < oldest]:
            del latest[worker_id]
        return pool_load([report.metrics for report in latest.values()])

    def _receiver(self, component: str) -> Callable[[Msg], Awaitable[None]]:
        async def receive(msg: Msg) -> None:
            self.receive(component, msg.subject, msg.data)

        return receive

    def receive(self, component: str, subject: str, data: bytes) -> None:
        """Keep one report as its worker's latest; a malformed one is counted, not raised."""
        try:
            metrics = decode(data, LoadMetrics)
            sender = instance_of_subject(subject)
        except (msgspec.MsgspecError, ValueError) as exc:
            self._malformed(subject, exc)
            return
        if metrics.worker_id != sender:
            self._malformed(subject, f"worker id {metrics.worker_id:x} on another's subject")
            return
        self._latest[component][sender] = Report(metrics, self._clock())
        self.stats.reports += 1

    def _malformed(self, subject: str, why: object) -> None:
        self.stats.malformed += 1
        log.debug("planner: malformed load report on %s: %s", subject, why)
