"""How many workers each pool needs for a forecast load, and when to change the count.

`size_pools` is the arithmetic (pure: a forecast and the models in, replicas out):

* a **decode** pool needs `ceil(rate * OSL / capacity)` workers, where `capacity` is the
  tokens/s one worker generates at the largest batch whose mean ITL stays within the
  budget (`DecodeModel.capacity_tokens_per_s`). The budget is the ITL target over the
  measured p90/mean ratio of ITL, since the model predicts means;
* a **prefill** pool needs the fewest workers whose predicted TTFT p90 at `rate / n`
  requests each stays within the TTFT target, none busier than `MAX_UTILISATION`;
* an **aggregated** pool needs the fewest workers meeting both at once: each spends
  `u = rate / n * S` of its time on prompts, so decode gets `1 - u` of it.

`Hysteresis` turns those needs into targets that do not flap: up at once (a spike does
not wait), down only after the need stayed below the current count for
`scale_down_intervals` intervals in a row and `cooldown_s` after the pool's last change,
and then only to the largest need of those intervals.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo.planner.forecast import LoadForecast
from dynamo.planner.perf_model import MAX_UTILISATION, DecodeModel, PrefillModel
from dynamo.planner.pools import PoolRole, PoolSpec


@dataclass(frozen=True)
class Targets:
    """The SLA: p90 TTFT and p90 ITL, in seconds."""

    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"targets must be positive, got TTFT {self.ttft_s}, ITL {self.itl_s}")


@dataclass(frozen=True)
class PoolNeed:
    """What one pool needs for the forecast load."""

    role: PoolRole
    replicas: int  # clamped to the pool's bounds
    capacity_rps: float  # requests/s one worker carries within the targets (0: none)
    unmet: bool = False  # even the pool's maximum does not meet the targets


@dataclass(frozen=True)
class PoolModels:
    """The performance models of a topology's pools."""

    decode: DecodeModel
    prefill: PrefillModel


def _decode_need(
    spec: PoolSpec, model: DecodeModel, load: LoadForecast, itl_budget_s: float
) -> PoolNeed:
    capacity_tps = model.capacity_tokens_per_s(itl_budget_s)
    osl = max(load.mean_osl, 1.0)
    demand_tps = load.request_rate * osl
    if capacity_tps <= 0:
        return PoolNeed(spec.role, spec.max_workers, 0.0, unmet=True)
    wanted = math.ceil(demand_tps / capacity_tps - 1e-9)
    return _clamped(spec, wanted, capacity_tps / osl)


def _largest_rate(within: Callable[[float], bool], upper: float) -> float:
    """The largest per-worker request rate in [0, upper] for which `within(rate)` holds
    (`within` holds at 0 and turns false once as the rate grows)."""
    lo, hi = 0.0, upper
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo


def _prefill_need(
    spec: PoolSpec, model: PrefillModel, load: LoadForecast, ttft_budget_s: float
) -> PoolNeed:
    isl = max(load.mean_isl, 1.0)
    service = model.service_s(isl)
    if service >= ttft_budget_s:  # a lone prompt already misses the target
        return PoolNeed(spec.role, spec.max_workers, 0.0, unmet=True)

    def within(rate: float) -> bool:
        return (
            model.utilisation(rate, isl) <= MAX_UTILISATION
            and model.ttft_s(rate, isl) <= ttft_budget_s
        )

    capacity = _largest_rate(within, MAX_UTILISATION / service)
    wanted = math.ceil(load.request_rate / capacity - 1e-9) if capacity > 0 else spec.max_workers
    return _clamped(spec, wanted, capacity)


def _aggregated_need(
    spec: PoolSpec, models: PoolModels, load: LoadForecast, targets: Targets, itl_budget_s: float
) -> PoolNeed:
    isl, osl = max(load.mean_isl, 1.0), max(load.mean_osl, 1.0)
    service = models.prefill.service_s(isl)

    def within(rate: float) -> bool:
        """Whether one worker receiving `rate` req/s meets both targets: prompts take
        `share` of its time, decode runs in the rest."""
        share = models.prefill.utilisation(rate, isl)
        if share >= MAX_UTILISATION:
            return False
        capacity_tps = models.decode.capacity_tokens_per_s(itl_budget_s * (1 - share))
        ttft = models.prefill.ttft_s(rate, isl) + models.decode.itl_s(1)
        return capacity_tps >= rate * osl and ttft <= targets.ttft_s

    if not within(0.0):  # a lone request already misses a target
        return PoolNeed(spec.role, spec.max_workers, 0.0, unmet=True)
    capacity = _largest_rate(within, MAX_UTILISATION / service)
    wanted = math.ceil(load.request_rate / capacity - 1e-9) if capacity > 0 else spec.max_workers
    return _clamped(spec, wanted, capacity)


def _clamped(spec: PoolSpec, wanted: int, capacity_rps: float) -> PoolNeed:
    return PoolNeed(spec.role, spec.clamp(wanted), capacity_rps, unmet=wanted > spec.max_workers)


def size_pools(
    specs: dict[PoolRole, PoolSpec],
    models: PoolModels,
    load: LoadForecast,
    targets: Targets,
    *,
    itl_tail_ratio: float = 1.0,
) -> dict[PoolRole, PoolNeed]:
    """The replicas each pool needs to carry `load` within `targets`. `itl_tail_ratio` is
    the measured p90/mean of ITL: the model predicts means, the target is a p90."""
    itl_budget_s = targets.itl_s / max(itl_tail_ratio, 1.0)
    needs: dict[PoolRole, PoolNeed] = {}
    for role, spec in specs.items():
        if role is PoolRole.AGGREGATED:
            needs[role] = _aggregated_need(spec, models, load, targets, itl_budget_s)
        elif role is PoolRole.PREFILL:
            needs[role] = _prefill_need(spec, models.prefill, load, targets.ttft_s)
        else:
            needs[role] = _decode_need(spec, models.decode, load, itl_budget_s)
    return needs


@dataclass(eq=False)
class Hysteresis:
    """Targets that follow the needs without flapping (see the module docstring)."""

    scale_down_intervals: int = 3
    cooldown_s: float = 60.0
    _below: dict[PoolRole, list[int]] = field(init=False, default_factory=dict)
    _changed_at: dict[PoolRole, float] = field(init=False, default_factory=dict)

    def target(self, role: PoolRole, current: int, needed: int, now: float) -> int:
        """The replicas to ask for now, given what runs and what the model needs."""
        if needed > current:
            self._below.pop(role, None)
            self._changed_at[role] = now
            return needed
        if needed == current:
            self._below.pop(role, None)
            return current
        below = self._below.setdefault(role, [])
        below.append(needed)
        cooled = now - self._changed_at.get(role, -math.inf) >= self.cooldown_s
        if len(below) < self.scale_down_intervals or not cooled:
            return current
        target = max(below[-self.scale_down_intervals :])
        self._below.pop(role, None)
        self._changed_at[role] = now
        return target
