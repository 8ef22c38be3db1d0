"""How much load one worker of each pool carries within the targets.

**Decode** (a decode worker, or the decode side of an aggregated one). From a speculation
profile (`dynamo.llm.speculation_profile`, measured by `python -m dynamo.vllm.profile_spec`
on the real engine): the step time `step(K, b)` at batch `b` for each K, and the acceptance
per draft position `a_i`. A request gains `1 + sum(a_i, i < K)` tokens per step, so its
inter-token latency is `step(K, b) / (1 + sum(a_i, i < K))`; a speculating worker runs the
K with the best goodput at its batch (what `--speculation-adapt` does), so the model takes
the K that minimises that latency. A worker without speculation runs the profile's
`no_speculation_step_ms`. One worker delivers `b / ITL(b)` tokens/s, and the largest batch
whose ITL stays within the budget sets its capacity.

Two live corrections keep the profile honest (the "fast loop"):

* **acceptance**: the frontends' speculative counters give the measured tokens per
  verification step at the K in force; the per-position rates are scaled so the model
  reproduces it. Acceptance falling from 2.4 to 1.3 tokens per step lowers a speculating
  worker's capacity, and the planner adds workers before the ITL target is missed.
* **step time**: measured mean ITL over the model's ITL at the measured batch per worker,
  smoothed, scales every predicted step time (the profile was measured on an idle
  machine; a served step costs more).

**Prefill** (a prefill worker, or the prefill side of an aggregated one): a prompt of `n`
uncached tokens takes `S = fixed + n * ms_per_token`; requests arriving at `r` per second
keep a worker busy `rho = r * S` of the time, and queue for `rho * S / (2 (1 - rho))` on
average (an M/D/1 queue: Poisson arrivals, service time nearly fixed for similar
prompts). The p90 of the wait is taken as `P90_WAIT_FACTOR` times the mean (ln 10: the
tail of an exponential), so `TTFT_p90 = S + 2.3 * rho * S / (2 (1 - rho))`. Measured TTFT
corrects `S` the same way measured ITL corrects the step times.

**Aggregated**: prefill shares the worker's steps with decode, so a fraction `u = r * S`
of the worker's time goes to prompts and decode runs at `1 - u` of its speed: the ITL
budget shrinks to `ITL_target * (1 - u)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo.llm.speculation_profile import SpeculationProfile, step_time

P90_WAIT_FACTOR = 2.3
"""p90 over mean of a queueing wait (ln 10 for an exponential tail)."""

MAX_UTILISATION = 0.9
"""A prefill (or aggregated) worker is never planned busier than this: near 1 the queue,
and so TTFT, grows without bound at the least noise."""

CORRECTION_BOUNDS = (0.5, 4.0)
"""How far measurements may move the model from the profile: beyond these the profile
is for another machine, and the planner says so rather than trusting either."""

CORRECTION_WEIGHT = 0.3
"""Weight of one interval's measurement in the smoothed corrections."""

MAX_PLANNED_BATCH = 512
"""The largest decode batch the model considers (vLLM's default --max-num-seqs is 256 on
GPU; a worker's KV blocks usually bound it first)."""


def _smooth(old: float, measured: float) -> float:
    lo, hi = CORRECTION_BOUNDS
    return min(hi, max(lo, (1 - CORRECTION_WEIGHT) * old + CORRECTION_WEIGHT * measured))


@dataclass(eq=False)
class DecodeModel:
    """ITL against batch size, K and acceptance for one decode worker."""

    profile: SpeculationProfile
    speculative: bool
    fixed_k: int | None = None  # workers run this K at every batch; None: the best K
    correction: float = 1.0  # measured / modelled step time, smoothed
    acceptance_scale: float = 1.0  # measured / profiled acceptance, smoothed
    max_batch: int = MAX_PLANNED_BATCH  # also bounded by the worker's KV blocks

    def __post_init__(self) -> None:
        if self.fixed_k is not None and not 0 <= self.fixed_k <= self.profile.max_k:
            raise ValueError(
                f"K={self.fixed_k} is outside the profile's K = 0..{self.profile.max_k}"
            )

    def ks(self) -> range:
        """The Ks a worker may run: its fixed K, or any the profile measured."""
        if not self.speculative:
            return range(1)
        if self.fixed_k is not None:
            return range(self.fixed_k, self.fixed_k + 1)
        return range(self.profile.max_k + 1)

    def acceptance(self) -> list[float]:
        """The per-position acceptance rates in force (profiled, scaled by measurement)."""
        return [min(1.0, a * self.acceptance_scale) for a in self.profile.acceptance_per_position]

    def tokens_per_step(self, k: int) -> float:
        return 1.0 + self.profile.drafted_fraction * sum(self.acceptance()[:k])

    def step_ms(self, k: int, batch: float) -> float:
        """The profile's step time, before the live correction."""
        if not self.speculative:
            plain = self.profile.no_speculation_step_ms or self.profile.times_for(0).step_ms
            return step_time(self.profile.batch_sizes, plain, batch)
        return step_time(self.profile.batch_sizes, self.profile.times_for(k).step_ms, batch)

    def itl_s(self, batch: float) -> float:
        """Mean seconds per generated token at `batch` (corrected) with the K run there."""
        best = min(self.step_ms(k, batch) / self.tokens_per_step(k) for k in self.ks())
        return self.correction * best / 1000.0

    def best_k(self, batch: float) -> int:
        return min(self.ks(), key=lambda k: self.step_ms(k, batch) / self.tokens_per_step(k))

    def largest_batch_within(self, itl_budget_s: float) -> int:
        """The largest batch whose ITL stays within the budget (0: not even one request)."""
        lo, hi = 0, self.max_batch
        while lo < hi:  # ITL grows with the batch: bisect for the last batch within budget
            mid = (lo + hi + 1) // 2
            if self.itl_s(mid) <= itl_budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def capacity_tokens_per_s(self, itl_budget_s: float) -> float:
        """Tokens per second one worker generates at the largest batch within budget."""
        batch = self.largest_batch_within(itl_budget_s)
        return batch / self.itl_s(batch) if batch else 0.0

    def observe_acceptance(self, tokens_per_step: float, k_in_force: int) -> None:
        """Fold in the measured tokens per verification step at K = `k_in_force`."""
        profiled = sum(self.profile.acceptance_per_position[:k_in_force])
        if not self.speculative or k_in_force < 1 or profiled <= 0:
            return
        # Per drafted step (the counters count steps that carried a draft), so the
        # drafted fraction does not enter: 1 + sum(a_i) is what a drafted step gains.
        wanted = max(0.0, tokens_per_step - 1.0)
        lo, hi = 0.0, 1.0 / min(a for a in self.profile.acceptance_per_position if a > 0)
        for _ in range(40):  # the scale that reproduces the measurement (rates capped at 1)
            mid = (lo + hi) / 2
            got = sum(min(1.0, a * mid) for a in self.profile.acceptance_per_position[:k_in_force])
            lo, hi = (mid, hi) if got < wanted else (lo, mid)
        measured = (lo + hi) / 2
        self.acceptance_scale = (
            1 - CORRECTION_WEIGHT
        ) * self.acceptance_scale + CORRECTION_WEIGHT * measured

    def observe_itl(self, itl_mean_s: float, batch: float, slowdown: float = 1.0) -> None:
        """Fold in a measured mean ITL at a measured batch per worker; `slowdown` is the
        factor the model already applies there (an aggregated worker's prefill share)."""
        if batch < 0.5 or itl_mean_s <= 0:
            return
        modelled = self.itl_s(batch) / self.correction * slowdown
        self.correction = _smooth(self.correction, itl_mean_s / modelled)


@dataclass(eq=False)
class PrefillModel:
    """Prompt time and TTFT against the arrival rate for one worker."""

    ms_per_token: float
    fixed_ms: float = 0.0
    correction: float = 1.0

    def service_s(self, isl: float) -> float:
        return self.correction * (self.fixed_ms + self.ms_per_token * isl) / 1000.0

    def utilisation(self, rate_per_worker: float, isl: float) -> float:
        return rate_per_worker * self.service_s(isl)

    def ttft_s(self, rate_per_worker: float, isl: float, *, p90: bool = True) -> float:
        """Predicted TTFT (p90, or mean) of a worker receiving `rate_per_worker` req/s;
        infinite at or past saturation."""
        service = self.service_s(isl)
        rho = rate_per_worker * service
        if rho >= 1.0:
            return float("inf")
        wait = rho * service / (2 * (1 - rho))
        return service + (P90_WAIT_FACTOR if p90 else 1.0) * wait

    def observe_ttft(self, ttft_mean_s: float, rate_per_worker: float, isl: float) -> None:
        """Fold in a measured mean TTFT at a measured rate per worker and prompt length:
        the correction moves toward measured over the profile's (uncorrected) TTFT."""
        profiled = PrefillModel(self.ms_per_token, self.fixed_ms)
        modelled = profiled.ttft_s(rate_per_worker, isl, p90=False)
        if not 0 < modelled < float("inf") or ttft_mean_s <= 0:
            return
        self.correction = _smooth(self.correction, ttft_mean_s / modelled)


@dataclass(frozen=True)
class MockerTimingFit:
    """The mocker's linear step-time model (`dynamo.mocker` timing flags) fitted to a
    profile by least squares, so simulated workers step as the profiled engine does:
    `step = per_step + per_token * b * (1 + K) + draft_per_token * K`."""

    decode_ms_per_step: float
    decode_ms_per_token: float
    draft_ms_per_token: float
    worst_relative_error: float  # over the profile's points

    def flags(self, prefill_ms_per_token: float) -> list[str]:
        return [
            "--decode-ms-per-step", f"{self.decode_ms_per_step:.3f}",
            "--decode-ms-per-token", f"{self.decode_ms_per_token:.4f}",
            "--draft-ms-per-token", f"{self.draft_ms_per_token:.4f}",
            "--prefill-ms-per-token", f"{prefill_ms_per_token:.4f}",
        ]  # fmt: skip


def fit_mocker_timing(profile: SpeculationProfile, *, speculative: bool) -> MockerTimingFit:
    """Fit the mocker's step-time model to the profile's measured step times (every K when
    `speculative`, else the engine without speculation)."""
    import numpy as np

    rows: list[tuple[float, ...]] = []  # (1, b * (1 + K), K) per measured point
    measured: list[float] = []
    if speculative:
        for times in profile.step_times:
            for b, ms in zip(profile.batch_sizes, times.step_ms, strict=True):
                rows.append((1.0, b * (1.0 + times.k), float(times.k)))
                measured.append(ms)
    else:
        plain = profile.no_speculation_step_ms or profile.times_for(0).step_ms
        for b, ms in zip(profile.batch_sizes, plain, strict=True):
            rows.append((1.0, float(b)))
            measured.append(ms)
    a, y = np.array(rows), np.array(measured)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    fitted = a @ coef
    worst = float(np.max(np.abs(fitted - y) / y))
    draft = float(coef[2]) if speculative else 0.0
    return MockerTimingFit(float(coef[0]), float(coef[1]), draft, worst)
