"""The planner's own Prometheus metrics, in a registry of its own (Grafana's planner row).

They answer the questions an operator asks of a planner: did it ask for the replicas it
should (target vs actual per pool), what load it planned for (observed vs forecast
request rate), whether the targets held (p90 TTFT/ITL vs target, and the share of
intervals that met both), and why it thinks a worker carries what it does (the capacity
per worker at the targets, the measured acceptance length that capacity follows under
speculation, and the online correction of the profiled performance model).

An own `CollectorRegistry` keeps `/metrics` to exactly these series and lets tests build
independent instances in one process.

Unlabelled readings (rates, latencies, targets, acceptance) are absent from `/metrics`
until first measured, not 0: a 0 s TTFT before the first interval would read as a met
target, and an acceptance length of 0 is impossible. Their `# TYPE` lines are always
there, so dashboards' queries name series that exist. Nothing non-finite is exported.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import TypeGuard
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily

from dynamo.planner.observation import TrafficWindow
from dynamo.planner.pools import PoolRole

PREFIX = "dynamo_planner"

MET, MISSED = "met", "missed"
"""The `result` label of `sla_intervals_total`."""
UP, DOWN = "up", "down"
"""The `direction` label of `scale_events_total`."""

REQUEST_RATE_OBSERVED = f"{PREFIX}_request_rate_observed"
REQUEST_RATE_FORECAST = f"{PREFIX}_request_rate_forecast"
TTFT_P90 = f"{PREFIX}_ttft_p90_seconds"
ITL_P90 = f"{PREFIX}_itl_p90_seconds"
TTFT_TARGET = f"{PREFIX}_ttft_target_seconds"
ITL_TARGET = f"{PREFIX}_itl_target_seconds"
ACCEPTANCE_LENGTH = f"{PREFIX}_acceptance_length"

_READINGS = {
    REQUEST_RATE_OBSERVED: "Requests per second that ended in the last interval (all frontends)",
    REQUEST_RATE_FORECAST: "Requests per second forecast for the next interval, which the "
    "replicas are sized for",
    TTFT_P90: "p90 time to first token over the last interval that measured one",
    ITL_P90: "p90 inter-token latency over the last interval that measured one",
    TTFT_TARGET: "The TTFT target the replicas are sized to meet",
    ITL_TARGET: "The ITL target the replicas are sized to meet",
    ACCEPTANCE_LENGTH: "Tokens per speculative verification step over the last interval "
    "that had one (accepted drafts plus the bonus token)",
}


def _finite(value: float | None) -> TypeGuard[float]:
    """A measured value: not None, not NaN, not infinite (what may be exported)."""
    return value is not None and math.isfinite(value)


class Readings:
    """Unlabelled gauges that stay absent until first set (a `Gauge` without labels
    would export 0 from the start). Writes come from the planner's loop, reads from the
    HTTP server's thread: one float per key, replaced whole."""

    def __init__(self, documentation: dict[str, str]) -> None:
        self._documentation = dict(documentation)
        self._values: dict[str, float] = {}

    def set(self, name: str, value: float) -> None:
        if name not in self._documentation:
            raise KeyError(name)
        self._values[name] = value

    def get(self, name: str) -> float | None:
        return self._values.get(name)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The families without samples: the registry checks names for clashes with it."""
        for name, documentation in self._documentation.items():
            yield GaugeMetricFamily(name, documentation)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation in self._documentation.items():
            family = GaugeMetricFamily(name, documentation)
            value = self._values.get(name)
            if value is not None:
                family.add_metric([], value)
            yield family


class PlannerMetrics:
    """All planner series; one instance per planner."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.readings = Readings(_READINGS)
        self.registry.register(self.readings)
        self.replicas_target = self._pool_gauge(
            "replicas_target", "Workers the planner asked for, per pool"
        )
        self.replicas_actual = self._pool_gauge(
            "replicas_actual", "Workers running, per pool, as the connector reports them"
        )
        self.worker_capacity = self._pool_gauge(
            "worker_capacity_rps",
            "Requests per second one worker sustains at the TTFT and ITL targets, per the "
            "planner's performance model (decode: with the measured acceptance length)",
        )
        self.model_correction = self._pool_gauge(
            "model_correction",
            "Online correction factor of the profiled performance model, per pool "
            "(1: the profile matches what the workers measure)",
        )
        self.sla_intervals = Counter(
            f"{PREFIX}_sla_intervals",
            "Planner intervals whose p90 TTFT and p90 ITL met their targets (met) or not "
            "(missed); an interval that measured no TTFT counts neither",
            ["result"],
            registry=self.registry,
        )
        self.scale_events = Counter(
            f"{PREFIX}_scale_events",
            "Replica changes the planner asked for, per pool and direction (up, down)",
            ["pool", "direction"],
            registry=self.registry,
        )
        # Both results exist from the start, so increase() sees the first interval.
        for result in (MET, MISSED):
            self.sla_intervals.labels(result)
        self._met = 0
        self._missed = 0
        self._ttft_target_s: float | None = None
        self._itl_target_s: float | None = None
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def _pool_gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(f"{PREFIX}_{name}", documentation, ["pool"], registry=self.registry)

    def set_targets(self, ttft_s: float, itl_s: float) -> None:
        """The targets that the intervals are judged against from now on."""
        self._ttft_target_s = ttft_s
        self._itl_target_s = itl_s
        self.readings.set(TTFT_TARGET, ttft_s)
        self.readings.set(ITL_TARGET, itl_s)

    def observed(self, traffic: TrafficWindow, forecast_rate: float) -> None:
        """One interval's traffic and the rate forecast for the next. A reading the window
        had nothing to measure from (None) keeps its previous value."""
        if traffic.seconds > 0:
            self.readings.set(REQUEST_RATE_OBSERVED, traffic.request_rate)
        self._set_if_measured(REQUEST_RATE_FORECAST, forecast_rate)
        self._set_if_measured(TTFT_P90, traffic.ttft_p90_s)
        self._set_if_measured(ITL_P90, traffic.itl_p90_s)
        self._set_if_measured(ACCEPTANCE_LENGTH, traffic.acceptance_length)
        result = self._judge(traffic)
        if result is not None:
            self.sla_intervals.labels(result).inc()
            if result == MET:
                self._met += 1
            else:
                self._missed += 1

    def _set_if_measured(self, name: str, value: float | None) -> None:
        if _finite(value):
            self.readings.set(name, value)

    def _judge(self, traffic: TrafficWindow) -> str | None:
        """MET, MISSED, or None for an interval that says nothing about the targets: no
        finished request, no TTFT measured (the requests' first tokens fell in earlier
        intervals), or no targets set yet. No ITL (every request ended at its first
        token) meets the ITL target: no gap was slow."""
        ttft_target, itl_target = self._ttft_target_s, self._itl_target_s
        if traffic.requests == 0 or ttft_target is None or itl_target is None:
            return None
        if traffic.ttft_p90_s is None:
            return None
        ttft_met = traffic.ttft_p90_s <= ttft_target
        itl_met = traffic.itl_p90_s is None or traffic.itl_p90_s <= itl_target
        return MET if ttft_met and itl_met else MISSED

    def pool(
        self, role: PoolRole, *, target: int, actual: int, capacity_rps: float, correction: float
    ) -> None:
        """One pool's state after the interval's decision. A non-finite capacity or
        correction (a model with nothing to go on yet) leaves the previous value."""
        pool = role.value
        self.replicas_target.labels(pool).set(target)
        self.replicas_actual.labels(pool).set(actual)
        if _finite(capacity_rps):
            self.worker_capacity.labels(pool).set(capacity_rps)
        if _finite(correction):
            self.model_correction.labels(pool).set(correction)
        # The pool's scale counters exist before its first scaling, for increase().
        for direction in (UP, DOWN):
            self.scale_events.labels(pool, direction)

    def scaled(self, role: PoolRole, direction: str) -> None:
        """The planner asked the connector for more (UP) or fewer (DOWN) workers."""
        if direction not in (UP, DOWN):
            raise ValueError(f"scale direction must be {UP!r} or {DOWN!r}, not {direction!r}")
        self.scale_events.labels(role.value, direction).inc()

    def attainment(self) -> float | None:
        """The share of counted intervals that met the targets (None before any)."""
        counted = self._met + self._missed
        return self._met / counted if counted else None

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """`/metrics` on `host:port` from a daemon thread (port 0: any free port, see
        `port`)."""
        if self._server is not None:
            raise RuntimeError(f"planner metrics already served on port {self.port}")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)

    @property
    def port(self) -> int | None:
        """The port `/metrics` is served on (None: not serving)."""
        return None if self._server is None else int(self._server.server_port)

    def close(self) -> None:
        """Stop serving `/metrics` (a no-op when not serving)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()
