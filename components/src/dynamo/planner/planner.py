"""`Planner`: one decision per interval, from what was observed to the replicas wanted.

Pure (no I/O, the clock passed in), so that the whole decision can be tested on made-up
observations: `service.py` does the observing and the acting around it.

Per interval, in order:

1. **learn**: fold the interval's measurements into the performance model (the measured
   acceptance at the K in force, mean ITL at the measured batch per worker, mean TTFT at
   the measured rate per prefill worker, the p90/mean ratio of ITL), each only from a
   window with enough finished requests to mean something;
2. **forecast** the next interval's rate and lengths (`forecast.py`), and plan for the
   larger of the forecast and what just arrived (a forecast that lags a spike must not
   shrink the response to it);
3. **size** each pool (`policy.size_pools`) and apply `Hysteresis`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dynamo.llm.speculation_profile import SpeculationProfile
from dynamo.planner.forecast import LoadForecast, LoadForecaster
from dynamo.planner.observation import Observation, PoolLoad, TrafficWindow
from dynamo.planner.perf_model import CORRECTION_WEIGHT, DecodeModel, PrefillModel
from dynamo.planner.policy import Hysteresis, PoolModels, PoolNeed, Targets, size_pools
from dynamo.planner.pools import PoolRole, PoolSpec

log = logging.getLogger(__name__)

MIN_REQUESTS_TO_LEARN = 5
"""Finished requests a window needs before its means correct the model."""


@dataclass(frozen=True)
class Decision:
    """One interval's outcome."""

    forecast: LoadForecast  # what the filters expect next
    planned: LoadForecast  # what the pools were sized for
    needs: dict[PoolRole, PoolNeed]
    targets: dict[PoolRole, int]  # replicas to ask for (hysteresis applied)


@dataclass(eq=False)
class Planner:
    """The decision of `python -m dynamo.planner`, one interval at a time."""

    pools: dict[PoolRole, PoolSpec]
    targets: Targets
    models: PoolModels
    hysteresis: Hysteresis
    default_isl: float = 256.0
    default_osl: float = 128.0
    forecaster: LoadForecaster = field(default_factory=LoadForecaster)
    itl_tail_ratio: float = 1.0  # measured p90 / mean ITL, smoothed
    last_acceptance: float | None = None  # tokens per verification step, last measured

    @classmethod
    def from_profile(
        cls,
        profile: SpeculationProfile,
        pools: dict[PoolRole, PoolSpec],
        targets: Targets,
        *,
        speculative: bool,
        fixed_k: int | None,
        prefill_ms_per_token: float,
        hysteresis: Hysteresis,
        default_isl: float = 256.0,
        default_osl: float = 128.0,
    ) -> Planner:
        decode = DecodeModel(profile, speculative, fixed_k=fixed_k)
        models = PoolModels(decode, PrefillModel(prefill_ms_per_token))
        return cls(pools, targets, models, hysteresis, default_isl, default_osl)

    @property
    def decode_role(self) -> PoolRole:
        return PoolRole.AGGREGATED if PoolRole.AGGREGATED in self.pools else PoolRole.DECODE

    def decide(self, seen: Observation, current: dict[PoolRole, int], now: float) -> Decision:
        traffic = seen.traffic
        self._learn(traffic, seen.pools, current)
        # Demand, not completions: under overload completions are capped by the fleet.
        self.forecaster.observe(
            traffic.arrival_rate, traffic.seconds, traffic.requests, traffic.mean_isl,
            traffic.mean_osl,
        )  # fmt: skip
        forecast = self.forecaster.forecast(self.default_isl, self.default_osl)
        planned = LoadForecast(
            request_rate=max(forecast.request_rate, traffic.arrival_rate),
            mean_isl=forecast.mean_isl,
            mean_osl=forecast.mean_osl,
        )
        needs = size_pools(
            self.pools, self.models, planned, self.targets, itl_tail_ratio=self.itl_tail_ratio
        )
        targets = {
            role: self.hysteresis.target(role, current.get(role, 0), need.replicas, now)
            for role, need in needs.items()
        }
        return Decision(forecast, planned, needs, targets)

    def _learn(
        self, traffic: TrafficWindow, loads: dict[PoolRole, PoolLoad], current: dict[PoolRole, int]
    ) -> None:
        if traffic.requests < MIN_REQUESTS_TO_LEARN:
            return
        decode_load = loads.get(self.decode_role, PoolLoad())
        self._learn_acceptance(traffic, decode_load)
        isl = traffic.mean_isl or self.default_isl
        prefill_role = PoolRole.PREFILL if PoolRole.PREFILL in self.pools else self.decode_role
        prefill_workers = max(
            current.get(prefill_role, 0), loads.get(prefill_role, PoolLoad()).workers
        )
        rate_per_prefill = traffic.request_rate / prefill_workers if prefill_workers else 0.0
        if traffic.ttft_mean_s is not None and prefill_workers:
            self.models.prefill.observe_ttft(traffic.ttft_mean_s, rate_per_prefill, isl)
        if traffic.itl_mean_s is not None and decode_load.workers:
            slowdown = 1.0
            if self.decode_role is PoolRole.AGGREGATED:
                share = self.models.prefill.utilisation(rate_per_prefill, isl)
                slowdown = 1.0 / (1.0 - min(share, 0.9))
            # The frontends' mean ITL is per token: compare it at the batch a token saw,
            # not the plain mean (an idle worker just started would pull that down and
            # make every step look slower than modelled).
            batch = decode_load.token_weighted_batch
            self.models.decode.observe_itl(traffic.itl_mean_s, batch, slowdown)
            if traffic.itl_p90_s is not None and traffic.itl_mean_s > 0:
                ratio = max(1.0, traffic.itl_p90_s / traffic.itl_mean_s)
                self.itl_tail_ratio = (
                    1 - CORRECTION_WEIGHT
                ) * self.itl_tail_ratio + CORRECTION_WEIGHT * ratio

    def _learn_acceptance(self, traffic: TrafficWindow, decode_load: PoolLoad) -> None:
        if traffic.acceptance_length is None:
            return
        self.last_acceptance = traffic.acceptance_length
        k = decode_load.k_in_force
        if k is None:
            k = self.models.decode.fixed_k
        if k is None:
            k = self.models.decode.best_k(max(decode_load.mean_active, 1.0))
        self.models.decode.observe_acceptance(traffic.acceptance_length, k)
