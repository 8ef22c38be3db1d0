"""The planner's decision on made-up observations: the forecast, the performance model,
the sizing of each pool, the hysteresis, and the online corrections.

The profile is the one shipped for the embedded model (Eagle3, measured on this machine),
so the figures below are the planner's view of real engine step times."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dynamo.llm.speculation_profile import SpeculationProfile, load_profile
from dynamo.planner.forecast import LoadForecast, LoadForecaster, TrendFilter
from dynamo.planner.observation import Observation, PoolLoad, TrafficWindow
from dynamo.planner.perf_model import (
    CORRECTION_BOUNDS,
    DecodeModel,
    PrefillModel,
    fit_mocker_timing,
)
from dynamo.planner.planner import Planner
from dynamo.planner.policy import Hysteresis, PoolModels, Targets, size_pools
from dynamo.planner.pools import PoolRole, PoolSpec

pytestmark = pytest.mark.unit

PROFILES = Path(__file__).parents[3] / "engine_configs" / "profiles" / "smollm2-135m-instruct"
AGG = {PoolRole.AGGREGATED: PoolSpec(PoolRole.AGGREGATED, "backend", 1, 8)}
DISAGG = {
    PoolRole.PREFILL: PoolSpec(PoolRole.PREFILL, "prefill", 1, 8),
    PoolRole.DECODE: PoolSpec(PoolRole.DECODE, "backend", 1, 8),
}
TARGETS = Targets(ttft_s=1.0, itl_s=0.1)


@pytest.fixture(scope="module")
def eagle3() -> SpeculationProfile:
    return load_profile(PROFILES / "eagle3.profile.json")


def window(rate: float, seconds: float = 10.0, **fields: float) -> TrafficWindow:
    return TrafficWindow(seconds=seconds, requests=round(rate * seconds), **fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- forecast


def test_a_steady_rate_is_forecast_as_itself() -> None:
    forecaster = LoadForecaster()
    for _ in range(10):
        forecaster.observe(4.0, 10.0, 40, 200.0, 100.0)
    forecast = forecaster.forecast(1.0, 1.0)
    assert forecast.request_rate == pytest.approx(4.0, rel=0.01)
    assert (forecast.mean_isl, forecast.mean_osl) == (pytest.approx(200.0), pytest.approx(100.0))


def test_a_ramp_is_anticipated_where_the_last_value_lags() -> None:
    rates = [1.0 + 0.5 * i for i in range(12)]  # +0.5 req/s per interval
    trend = TrendFilter()
    for rate in rates:
        trend.update(rate, rate / 100.0)
    next_rate = rates[-1] + 0.5
    assert abs(trend.forecast() - next_rate) < abs(rates[-1] - next_rate)


def test_lengths_never_measured_take_the_defaults() -> None:
    forecaster = LoadForecaster()
    forecaster.observe(0.0, 10.0, 0, None, None)
    assert forecaster.forecast(300.0, 50.0) == LoadForecast(0.0, 300.0, 50.0)


# ---------------------------------------------------------------------------- model


def test_speculation_lowers_itl_at_small_batch_and_adaptive_k_backs_off(
    eagle3: SpeculationProfile,
) -> None:
    plain, adaptive = DecodeModel(eagle3, False), DecodeModel(eagle3, True)
    assert adaptive.itl_s(1) < plain.itl_s(1)  # the profile's c=1 gain
    assert adaptive.best_k(1) == 3
    assert adaptive.best_k(64) < 3  # the batch pays for drafts less than they give back
    fixed = DecodeModel(eagle3, True, fixed_k=3)
    assert fixed.itl_s(64) >= adaptive.itl_s(64)


def test_capacity_follows_the_measured_acceptance(eagle3: SpeculationProfile) -> None:
    model = DecodeModel(eagle3, True, fixed_k=3)
    before = model.capacity_tokens_per_s(0.1)
    for _ in range(20):  # acceptance collapses to 1.2 tokens per step
        model.observe_acceptance(1.2, 3)
    assert model.tokens_per_step(3) == pytest.approx(1.2, abs=0.02)
    assert model.capacity_tokens_per_s(0.1) < before
    for _ in range(20):  # and recovers past the profile's
        model.observe_acceptance(2.2, 3)
    assert model.tokens_per_step(3) == pytest.approx(2.2, abs=0.02)
    assert model.capacity_tokens_per_s(0.1) > before


def test_the_step_correction_reads_the_batch_the_tokens_saw(eagle3: SpeculationProfile) -> None:
    """One busy worker and a new idle one: the measured ITL is the busy worker's (the idle
    one emits no token), so the model must be compared at its batch, not the mean."""
    plan = planner(eagle3, {PoolRole.DECODE: DISAGG[PoolRole.DECODE]})
    busy, idle = 16, 0
    load = PoolLoad(
        workers=2, active_requests=busy + idle,
        token_weighted_batch=(busy**2 + idle**2) / (busy + idle),
    )  # fmt: skip
    itl = plan.models.decode.itl_s(busy)  # exactly what the profile predicts at 16
    seen = window(5, mean_isl=100.0, mean_osl=100.0, itl_mean_s=itl, itl_p90_s=itl)
    for t in range(10):
        plan.decide(Observation(seen, {PoolRole.DECODE: load}), {PoolRole.DECODE: 2}, t * 10.0)
    assert plan.models.decode.correction == pytest.approx(1.0)


def test_a_slower_served_step_lowers_capacity_within_bounds(eagle3: SpeculationProfile) -> None:
    model = DecodeModel(eagle3, False)
    before = model.capacity_tokens_per_s(0.1)
    modelled = model.itl_s(16)
    for _ in range(30):
        model.observe_itl(modelled * 1.5, 16)
    assert model.correction == pytest.approx(1.5, rel=0.02)
    assert model.capacity_tokens_per_s(0.1) < before
    for _ in range(60):  # a measurement from another machine is bounded, not followed
        model.observe_itl(modelled * 100, 16)
    assert model.correction == CORRECTION_BOUNDS[1]


def test_prefill_ttft_grows_with_load_and_saturates() -> None:
    model = PrefillModel(ms_per_token=2.0)
    service = model.service_s(200)
    assert model.ttft_s(0.0, 200) == pytest.approx(service)
    assert model.ttft_s(1.0, 200) > model.ttft_s(0.5, 200) > service
    assert model.ttft_s(1 / service, 200) == math.inf


def test_a_steady_ttft_measurement_settles_the_prefill_correction() -> None:
    """The correction moves toward measured over the profile's TTFT, not over the already
    corrected one (which would compound it interval after interval)."""
    model = PrefillModel(ms_per_token=2.0)
    measured = 1.6 * model.ttft_s(0.5, 200, p90=False)
    for _ in range(40):
        model.observe_ttft(measured, 0.5, 200)
    assert model.correction == pytest.approx(1.6, rel=0.01)


def test_the_mocker_fit_reproduces_the_profile(eagle3: SpeculationProfile) -> None:
    plain = fit_mocker_timing(eagle3, speculative=False)
    assert plain.worst_relative_error < 0.1
    assert plain.draft_ms_per_token == 0.0
    spec = fit_mocker_timing(eagle3, speculative=True)
    assert spec.worst_relative_error < 0.2  # a linear model; the drafter's K=0 cost is not in it
    flags = spec.flags(prefill_ms_per_token=1.8)
    assert flags[flags.index("--prefill-ms-per-token") + 1] == "1.8000"


# ---------------------------------------------------------------------------- sizing


def test_pools_grow_with_the_load(eagle3: SpeculationProfile) -> None:
    models = PoolModels(DecodeModel(eagle3, False), PrefillModel(1.8))
    for specs in (AGG, DISAGG):
        counts = [
            sum(n.replicas for n in size_pools(specs, models, LoadForecast(r, 100, 100), TARGETS).values())
            for r in (0.5, 2, 4, 8, 16)
        ]  # fmt: skip
        assert counts == sorted(counts) and counts[-1] > counts[0], counts


def test_a_pool_is_clamped_to_its_bounds_and_says_when_the_maximum_is_not_enough(
    eagle3: SpeculationProfile,
) -> None:
    models = PoolModels(DecodeModel(eagle3, False), PrefillModel(1.8))
    small = size_pools(DISAGG, models, LoadForecast(0.0, 100, 100), TARGETS)
    assert {n.replicas for n in small.values()} == {1}
    huge = size_pools(DISAGG, models, LoadForecast(500.0, 100, 100), TARGETS)
    assert all(n.replicas == 8 and n.unmet for n in huge.values())


def test_an_unreachable_target_is_unmet_not_a_crash(eagle3: SpeculationProfile) -> None:
    models = PoolModels(DecodeModel(eagle3, False), PrefillModel(1.8))
    needs = size_pools(DISAGG, models, LoadForecast(1.0, 100, 100), Targets(0.01, 0.001))
    assert all(n.unmet and n.capacity_rps == 0.0 for n in needs.values())


# ---------------------------------------------------------------------------- hysteresis


def test_growth_is_immediate_and_shrinking_waits_for_a_steady_lower_need() -> None:
    hysteresis = Hysteresis(scale_down_intervals=3, cooldown_s=30.0)
    role = PoolRole.DECODE
    assert hysteresis.target(role, current=2, needed=5, now=0.0) == 5
    # Lower needs, but within the cool-down of the last change: hold.
    assert [hysteresis.target(role, 5, 2, t) for t in (10.0, 20.0)] == [5, 5]
    # The third low interval past the cool-down: down to the largest recent need.
    assert hysteresis.target(role, 5, 3, 40.0) == 3
    # A need back at the count resets the streak.
    assert hysteresis.target(role, 3, 3, 50.0) == 3
    assert [hysteresis.target(role, 3, 1, t) for t in (100.0, 110.0)] == [3, 3]
    assert hysteresis.target(role, 3, 1, 120.0) == 1


# ---------------------------------------------------------------------------- the whole decision


def planner(profile: SpeculationProfile, specs: dict[PoolRole, PoolSpec], **kw: object) -> Planner:
    return Planner.from_profile(
        profile, specs, TARGETS, speculative=bool(kw.get("speculative", False)),
        fixed_k=kw.get("fixed_k"), prefill_ms_per_token=1.8,  # type: ignore[arg-type]
        hysteresis=Hysteresis(scale_down_intervals=2, cooldown_s=0.0),
    )  # fmt: skip


def test_a_spike_scales_up_at_once_and_the_fall_scales_down_later(
    eagle3: SpeculationProfile,
) -> None:
    plan = planner(eagle3, DISAGG)
    current = {PoolRole.PREFILL: 1, PoolRole.DECODE: 1}
    lengths = {"mean_isl": 100.0, "mean_osl": 100.0}
    history = []
    for t, rate in enumerate([1, 1, 1, 12, 12, 12, 1, 1, 1, 1, 1]):
        decision = plan.decide(Observation(window(rate, **lengths)), current, t * 10.0)
        current = decision.targets
        history.append(sum(current.values()))
    assert history[3] > history[2]  # the spike's own interval
    assert max(history[3:6]) == history[3]
    assert history[-1] < max(history)  # back down after the fall
    assert history[6] == history[5]  # but not in the first low interval


def test_demand_that_piles_up_counts_even_when_completions_cannot_grow(
    eagle3: SpeculationProfile,
) -> None:
    lengths = {"mean_isl": 100.0, "mean_osl": 100.0}
    current = {PoolRole.PREFILL: 1, PoolRole.DECODE: 1}
    capped = planner(eagle3, DISAGG).decide(Observation(window(3, **lengths)), current, 0.0)
    piling = planner(eagle3, DISAGG).decide(
        Observation(window(3, inflight_change=200, **lengths)), current, 0.0
    )
    assert piling.planned.request_rate == pytest.approx(23.0)
    assert sum(piling.targets.values()) > sum(capped.targets.values())


def test_falling_acceptance_adds_decode_workers(eagle3: SpeculationProfile) -> None:
    specs = {PoolRole.DECODE: DISAGG[PoolRole.DECODE]}
    plan = planner(eagle3, specs, speculative=True, fixed_k=3)
    load = {
        PoolRole.DECODE: PoolLoad(
            workers=2, active_requests=40, k_in_force=3, token_weighted_batch=20.0
        )
    }
    current = {PoolRole.DECODE: 2}
    good = window(9, mean_isl=100.0, mean_osl=100.0, acceptance_length=2.2)
    first = plan.decide(Observation(good, load), current, 0.0)
    bad = window(9, mean_isl=100.0, mean_osl=100.0, acceptance_length=1.1)
    for t in range(1, 10):
        last = plan.decide(Observation(bad, load), current, t * 10.0)
    assert last.needs[PoolRole.DECODE].capacity_rps < first.needs[PoolRole.DECODE].capacity_rps
    assert last.needs[PoolRole.DECODE].replicas > first.needs[PoolRole.DECODE].replicas
    assert plan.last_acceptance == 1.1
