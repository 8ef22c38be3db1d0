"""The planner's own `/metrics` (`PlannerMetrics`), read back from its registry.

Claims: each method moves exactly its series; an interval counts as met when its p90 TTFT
and p90 ITL are within their targets, as missed otherwise, and not at all when it says
nothing about the targets (no finished request, no TTFT measured, no targets yet), while
an interval without ITL (no second token) meets the ITL target; attainment is met over
counted intervals; readings are absent until measured (never 0 or NaN in their place);
`serve` answers `/metrics` over HTTP with the series."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from dynamo.planner.metrics import DOWN, MET, MISSED, UP, PlannerMetrics
from dynamo.planner.observation import TrafficWindow
from dynamo.planner.pools import PoolRole
from dynamo.testing.dashboard import exported_names
from dynamo.testing.http import http_get

pytestmark = pytest.mark.unit

TTFT_TARGET, ITL_TARGET = 0.5, 0.05


def _metrics() -> PlannerMetrics:
    metrics = PlannerMetrics()
    metrics.set_targets(TTFT_TARGET, ITL_TARGET)
    return metrics


def _value(metrics: PlannerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"dynamo_planner_{name}", labels)


def _counted(metrics: PlannerMetrics) -> tuple[float | None, float | None]:
    return (
        _value(metrics, "sla_intervals_total", result=MET),
        _value(metrics, "sla_intervals_total", result=MISSED),
    )


def _window(
    ttft: float | None = 0.2, itl: float | None = 0.02, requests: int = 10
) -> TrafficWindow:
    return TrafficWindow(seconds=5.0, requests=requests, ttft_p90_s=ttft, itl_p90_s=itl)


def test_an_own_registry_is_used_and_a_given_one_is_kept() -> None:
    registry = CollectorRegistry()
    assert PlannerMetrics(registry).registry is registry
    assert PlannerMetrics().registry is not PlannerMetrics().registry


def test_readings_are_absent_until_measured_and_counters_start_at_zero() -> None:
    metrics = PlannerMetrics()
    for name in (
        "request_rate_observed",
        "request_rate_forecast",
        "ttft_p90_seconds",
        "itl_p90_seconds",
        "ttft_target_seconds",
        "itl_target_seconds",
        "acceptance_length",
    ):
        assert _value(metrics, name) is None, name
    assert _counted(metrics) == (0.0, 0.0)
    assert metrics.attainment() is None


def test_set_targets_exports_both_targets() -> None:
    metrics = _metrics()
    assert _value(metrics, "ttft_target_seconds") == TTFT_TARGET
    assert _value(metrics, "itl_target_seconds") == ITL_TARGET


def test_observed_sets_rates_latencies_and_acceptance() -> None:
    metrics = _metrics()
    traffic = TrafficWindow(
        seconds=4.0, requests=10, ttft_p90_s=0.3, itl_p90_s=0.04, acceptance_length=2.5
    )
    metrics.observed(traffic, forecast_rate=3.0)
    assert _value(metrics, "request_rate_observed") == 2.5
    assert _value(metrics, "request_rate_forecast") == 3.0
    assert _value(metrics, "ttft_p90_seconds") == 0.3
    assert _value(metrics, "itl_p90_seconds") == 0.04
    assert _value(metrics, "acceptance_length") == 2.5


def test_a_reading_the_window_could_not_measure_keeps_its_last_value() -> None:
    metrics = _metrics()
    measured = TrafficWindow(
        seconds=5.0, requests=5, ttft_p90_s=0.3, itl_p90_s=0.04, acceptance_length=2.0
    )
    metrics.observed(measured, forecast_rate=1.0)
    metrics.observed(TrafficWindow(seconds=5.0), forecast_rate=0.5)
    assert _value(metrics, "request_rate_observed") == 0.0  # nothing ended: a measured 0
    assert _value(metrics, "request_rate_forecast") == 0.5
    assert _value(metrics, "ttft_p90_seconds") == 0.3
    assert _value(metrics, "itl_p90_seconds") == 0.04
    assert _value(metrics, "acceptance_length") == 2.0


def test_non_finite_values_are_never_exported() -> None:
    metrics = _metrics()
    metrics.observed(_window(ttft=math.nan), forecast_rate=math.inf)
    assert _value(metrics, "ttft_p90_seconds") is None
    assert _value(metrics, "request_rate_forecast") is None
    metrics.pool(PoolRole.DECODE, target=2, actual=2, capacity_rps=math.nan, correction=math.inf)
    assert _value(metrics, "worker_capacity_rps", pool="decode") is None
    assert _value(metrics, "model_correction", pool="decode") is None


@pytest.mark.parametrize(
    ("traffic", "counted"),
    [
        (_window(ttft=0.2, itl=0.02), (1.0, 0.0)),
        (_window(ttft=TTFT_TARGET, itl=ITL_TARGET), (1.0, 0.0)),  # at the target: met
        (_window(ttft=0.6, itl=0.02), (0.0, 1.0)),
        (_window(ttft=0.2, itl=0.06), (0.0, 1.0)),
        (_window(ttft=0.2, itl=None), (1.0, 0.0)),  # no second token: no slow gap
        (_window(ttft=0.6, itl=None), (0.0, 1.0)),
        (_window(requests=0), (0.0, 0.0)),
        (_window(ttft=None, itl=0.02), (0.0, 0.0)),  # first tokens in earlier windows
    ],
    ids=[
        "met",
        "met-at-target",
        "missed-ttft",
        "missed-itl",
        "no-itl-met",
        "no-itl-missed-ttft",
        "empty-window",
        "no-ttft",
    ],
)
def test_sla_interval_counting(traffic: TrafficWindow, counted: tuple[float, float]) -> None:
    metrics = _metrics()
    metrics.observed(traffic, forecast_rate=1.0)
    assert _counted(metrics) == counted


def test_no_interval_is_counted_before_the_targets_are_set() -> None:
    metrics = PlannerMetrics()
    metrics.observed(_window(), forecast_rate=1.0)
    assert _counted(metrics) == (0.0, 0.0)
    assert metrics.attainment() is None
    assert _value(metrics, "ttft_p90_seconds") == 0.2  # the readings are still exported


def test_attainment_is_met_over_counted_intervals() -> None:
    metrics = _metrics()
    for traffic in (_window(), _window(ttft=0.9), _window(requests=0), _window(itl=None)):
        metrics.observed(traffic, forecast_rate=1.0)
    assert _counted(metrics) == (2.0, 1.0)
    assert metrics.attainment() == pytest.approx(2 / 3)


def test_pool_sets_its_series_under_its_role() -> None:
    metrics = _metrics()
    metrics.pool(PoolRole.PREFILL, target=3, actual=2, capacity_rps=1.5, correction=1.2)
    metrics.pool(PoolRole.DECODE, target=4, actual=4, capacity_rps=0.8, correction=0.9)
    assert _value(metrics, "replicas_target", pool="prefill") == 3
    assert _value(metrics, "replicas_actual", pool="prefill") == 2
    assert _value(metrics, "worker_capacity_rps", pool="prefill") == 1.5
    assert _value(metrics, "model_correction", pool="prefill") == 1.2
    assert _value(metrics, "replicas_target", pool="decode") == 4
    assert _value(metrics, "worker_capacity_rps", pool="decode") == 0.8
    assert _value(metrics, "replicas_target", pool="aggregated") is None
    # The pool's scale counters exist at 0 before any scaling (increase() needs a start).
    assert _value(metrics, "scale_events_total", pool="decode", direction=UP) == 0.0
    assert _value(metrics, "scale_events_total", pool="decode", direction=DOWN) == 0.0


def test_scaled_counts_per_pool_and_direction() -> None:
    metrics = _metrics()
    metrics.scaled(PoolRole.AGGREGATED, UP)
    metrics.scaled(PoolRole.AGGREGATED, UP)
    metrics.scaled(PoolRole.AGGREGATED, DOWN)
    assert _value(metrics, "scale_events_total", pool="aggregated", direction=UP) == 2.0
    assert _value(metrics, "scale_events_total", pool="aggregated", direction=DOWN) == 1.0
    with pytest.raises(ValueError, match="sideways"):
        metrics.scaled(PoolRole.AGGREGATED, "sideways")


def test_serve_answers_metrics_over_http() -> None:
    metrics = _metrics()
    metrics.pool(PoolRole.AGGREGATED, target=2, actual=1, capacity_rps=3.0, correction=1.0)
    metrics.observed(_window(), forecast_rate=2.0)
    metrics.serve(0, host="127.0.0.1")
    try:
        port = metrics.port
        assert port is not None and port > 0
        with pytest.raises(RuntimeError):
            metrics.serve(0, host="127.0.0.1")
        status, text = http_get(f"http://127.0.0.1:{port}/metrics", timeout=30)
    finally:
        metrics.close()
    assert status == 200
    assert 'dynamo_planner_replicas_target{pool="aggregated"} 2.0' in text
    assert 'dynamo_planner_sla_intervals_total{result="met"} 1.0' in text
    assert "dynamo_planner_request_rate_forecast 2.0" in text
    assert {"dynamo_planner_acceptance_length", "dynamo_planner_scale_events_total"} <= (
        exported_names(text)
    )
    assert metrics.port is None
