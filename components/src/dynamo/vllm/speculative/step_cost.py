"""The step-time model of adaptive speculation (`speculative.adaptive_k`): the profile's
step time per K and batch size, corrected by this worker's measured steps, with the
profile's excess over K = 0 as a floor until a K's own steps speak for it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dynamo.llm.speculation_profile import SpeculationProfile, step_time
from dynamo.vllm.speculative.acceptance import DecayedRate

RATIO_BOUNDS = (0.25, 4.0)
"""A measured step further than this from the profile's (as a ratio) counts at the bound:
one stall, the machine busy with something else, must not decide for a whole window."""


def batch_bucket(batch: int) -> int:
    """The power of two nearest `batch` (in log scale), as its exponent: the buckets
    step-time corrections are kept in."""
    return max(0, round(math.log2(max(batch, 1))))


@dataclass
class StepCost:
    """The profile's step time at (K, batch), corrected by measured steps."""

    profile: SpeculationProfile
    decay: float
    k0_ms: Sequence[float]  # what a step without drafting costs (the plain engine's)
    trusted_steps: float
    """Measured steps of a K at a bucket after which its time stands (`trusted`)."""
    ratios: dict[int, dict[int, DecayedRate]] = field(default_factory=dict)
    """K -> batch bucket (`batch_bucket`) -> measured over profiled time."""
    _fitted: dict[tuple[int, int], list[float]] = field(default_factory=dict, repr=False)
    """`fitted_times` by (batch, largest K fitted), until the next measured step."""

    def profiled_ms(self, k: int, batch: int) -> float:
        times = self.k0_ms if k == 0 else self.profile.times_for(k).step_ms
        return step_time(self.profile.batch_sizes, times, batch)

    def observe(self, k: int, batch: int, measured_ms: float) -> None:
        """One measured step that drafted `k` tokens for a batch of `batch`."""
        if measured_ms <= 0 or batch < 1:
            return
        low, high = RATIO_BOUNDS
        sample = min(max(measured_ms / self.profiled_ms(k, batch), low), high)
        ratio = self.ratios.setdefault(k, {}).setdefault(batch_bucket(batch), DecayedRate(0, 0))
        ratio.fade(self.decay)
        ratio.add(sample, 1.0)
        self._fitted.clear()

    def correction(self, k: int, batch: int | None = None) -> float:
        """Measured over profiled time for K at `batch` (None: over every batch size,
        weighted by measurements). A K > 0 not measured yet borrows the mean of the
        measured Ks (1 before any measurement). K = 0 not measured yet keeps the
        profile's time: borrowing a drafting K's ratio would price no speculation as
        dearly as speculation served costs, and a worker that never runs K = 0 would never
        learn otherwise (seen: n-gram kept K = 3 at 16 sequences, 0.82x no speculation).
        Priced at the profile, K = 0 wins where served drafting costs more than profiled,
        runs, and is measured from then on."""
        if k > 0 and batch is not None:
            borrowed = self._borrowed(k, batch_bucket(batch))
            if borrowed is not None:
                return borrowed
        own = self._measured(k, batch)
        if own is not None:
            return own
        if k == 0:
            return 1.0
        measured = [r for r in (self._measured(j, batch) for j in self.ratios) if r is not None]
        return sum(measured) / len(measured) if measured else 1.0

    def _borrowed(self, k: int, bucket: int) -> float | None:
        """A drafting K's ratio at `bucket` where K was not measured but K = 0 was, from
        two estimates: K's own ratio at the nearest bucket where it ran, and K = 0's ratio
        here times K's excess over K = 0 at the nearest bucket where both ran
        (`_relative_to_k0`). What served drafting adds over K = 0 grows with the batch, so
        from a smaller batch both estimates are low and the higher is taken (K's own
        ratio from 4 sequences priced K = 1 cheap at 16 beside K = 0's served cost there:
        a third of the steps at 16 drafted, at 1.4x a K = 0 step, and n-gram served 0.89x
        no speculation); from a larger batch both are high and the lower is taken (the
        excess at 4 sequences, carried to 1, kept n-gram at K = 0 where K = 2 paid). None
        where K was measured here, never, or K = 0 was not measured here."""
        if self._bucket(k, bucket) is not None:
            return None
        own = self._measured(k, 2**bucket)
        relative = self._relative_to_k0(k, bucket)
        if own is None or relative is None:
            return None
        measured = [b for b, r in self.ratios.get(k, {}).items() if r.trials > 1e-9]
        nearest = min(measured, key=lambda b: (abs(b - bucket), -b))
        return max(own, relative) if nearest < bucket else min(own, relative)

    def _relative_to_k0(self, k: int, bucket: int) -> float | None:
        """K = 0's ratio at `bucket` times K's ratio over K = 0's at the nearest bucket
        where both were measured; None where K = 0 was not measured at `bucket` or never
        beside K."""
        plain = self._bucket(0, bucket)
        if plain is None:
            return None
        excess = self._nearest_beside_k0(
            k, bucket, lambda b: self.ratios[k][b].rate(1.0) / (self._bucket(0, b) or 1.0)
        )
        return None if excess is None else plain * excess

    def widening(self, k: int, bucket: int) -> float:
        """How much wider a drafting K's excess over K = 0 was served than profiled, at
        the nearest bucket to `bucket` where both ran (the mean of two as near), from the
        fitted step times there (`fitted_times`, so a few steps of one K do not speak
        louder than the fit). A K that never ran beside K = 0 takes the widening of the
        largest smaller K that did (drafting more adds at least as much); 1 where none
        did."""
        for j in range(k, 0, -1):
            widening = self._nearest_beside_k0(j, bucket, lambda b, j=j: self._widening_at(j, b))
            if widening is not None:
                return widening
        return 1.0

    def _widening_at(self, k: int, bucket: int) -> float:
        batch = 2**bucket
        times = self.fitted_times(batch, k)
        return (times[k] / times[0]) / (self.profiled_ms(k, batch) / self.profiled_ms(0, batch))

    def _nearest_beside_k0(
        self, k: int, bucket: int, value: Callable[[int], float]
    ) -> float | None:
        """The mean of `value(b)` over the buckets b nearest `bucket` where K and K = 0
        were both measured; None where they never were at one bucket."""
        both = [
            b
            for b, rate in self.ratios.get(k, {}).items()
            if rate.trials > 1e-9 and self._bucket(0, b) is not None
        ]
        if not both:
            return None
        nearest = min(abs(b - bucket) for b in both)
        values = [value(b) for b in both if abs(b - bucket) == nearest]
        return sum(values) / len(values)

    def _bucket(self, k: int, bucket: int) -> float | None:
        """K's measured ratio at exactly `bucket`, None where it was not measured."""
        rate = self.ratios.get(k, {}).get(bucket)
        return rate.rate(1.0) if rate is not None and rate.trials > 1e-9 else None

    def _measured(self, k: int, batch: int | None) -> float | None:
        """K's ratio at the bucket of `batch`, else at the nearest bucket measured (the
        mean of two as near); every bucket's, weighted, when `batch` is None."""
        buckets = {b: r for b, r in self.ratios.get(k, {}).items() if r.trials > 1e-9}
        if not buckets:
            return None
        if batch is None:
            trials = sum(r.trials for r in buckets.values())
            return sum(r.hits for r in buckets.values()) / trials
        want = batch_bucket(batch)
        nearest = min(abs(b - want) for b in buckets)
        rates = [r.rate(1.0) for b, r in buckets.items() if abs(b - want) == nearest]
        return sum(rates) / len(rates)

    def by_batch(self) -> dict[int, list[float | None]]:
        """For the log: per measured batch bucket (as its batch size), the ratio of each K
        measured there (None where it was not)."""
        buckets = sorted({b for per_k in self.ratios.values() for b in per_k})
        max_k = max(self.ratios, default=0)
        table: dict[int, list[float | None]] = {}
        for bucket in buckets:
            row: list[float | None] = []
            for k in range(max_k + 1):
                ratio = self.ratios.get(k, {}).get(bucket)
                row.append(round(ratio.rate(1.0), 2) if ratio and ratio.trials > 1e-9 else None)
            table[2**bucket] = row
        return table

    def step_ms(self, k: int, batch: int) -> float:
        """The corrected step time at K (see `step_times`)."""
        return self.step_times(batch, k)[k]

    def step_times(self, batch: int, max_k: int = 0) -> list[float]:
        """The corrected step time at every K up to the profile's largest (or `max_k`, if
        larger), never below a smaller K's: a step verifies and
        drafts more tokens as K grows, so a K that measured cheaper than a smaller one
        measured noise (on CPU the steps of neighbouring Ks differ by a few percent, as
        much as two measurements of one K do), and must not win on it. Such Ks are
        pooled at their mean weighted by the steps that measured each (`monotone_fit`):
        taking the larger instead let a few K = 1 steps at one sequence (1.02x the
        profile) price K = 2, measured over hundreds of steps at 0.82x, and n-gram stayed
        at K = 0 in most steps at one sequence where a static K = 2 served 1.14x no
        speculation."""
        ks = range(max(max_k, self.profile.max_k) + 1)
        profiled = [self.profiled_ms(j, batch) for j in ks]
        fitted = self.fitted_times(batch, max_k)
        # Not less over K = 0 than the profile's own excess, until K has run here long
        # enough to speak for itself: serving adds contention to a drafting step, and K = 0
        # and K = 1 measured at different moments (the frontend busy with arrivals during
        # one, not the other) once put K = 1 at 1.04x K = 0 at 32 sequences, where the
        # profile says 1.14x and a static K = 2 served 0.69x no speculation. But the
        # profile's excess is one measurement too: at one sequence it put Eagle3's K = 3
        # at 1.31x K = 0 where served steps measured 1.16x over hundreds of steps, and
        # held that way K = 3 only tied K = 1 where a static K = 3 served 1.2x as much.
        # Where serving widened K's excess at another batch size, the floor widens with
        # it: entering 16 sequences, where neither K had run, n-gram's K = 1 was held
        # only to the profile's excess while at 4 sequences it had served 1.2-1.3x that
        # excess, and about 75 steps drafted at a loss before K = 1 was measured there.
        # The floor gives way step by step as K's own steps here add up (`trust`), not at
        # once at half a window: Eagle3's K = 2 at one sequence ran about 90 steps at
        # 0.8x the profile, 1.14x K = 0 where the profile says 1.33x, then, still held to
        # the whole floor, lost to K = 1 and was never chosen again (1.14x no speculation
        # where a static K = 2 served 1.27x).
        bucket = batch_bucket(batch)
        times = []
        for k, (time, ms) in enumerate(zip(fitted, profiled, strict=True)):
            doubt = 1.0 - self.trust(k, batch)
            if doubt > 0.0:  # the floor (and its widening lookups) only where it weighs
                floor = fitted[0] * ms / profiled[0] * max(self.widening(k, bucket), 1.0)
                time += doubt * max(floor - time, 0.0)
            times.append(time)
        return times

    def fitted_times(self, batch: int, max_k: int = 0) -> list[float]:
        """The profile's step time at every K, each times its correction, made
        non-decreasing in K (`monotone_fit`, weighted by the steps that measured each)."""
        top = max(max_k, self.profile.max_k)  # every max_k up to the profile's is one fit
        cached = self._fitted.get((batch, top))
        if cached is None:
            ks = range(top + 1)
            times = [self.profiled_ms(j, batch) * self.correction(j, batch) for j in ks]
            cached = monotone_fit(times, [self.weight(j, batch) for j in ks])
            self._fitted[(batch, top)] = cached
        return list(cached)

    def trust(self, k: int, batch: int) -> float:
        """How far K's own time at the bucket of `batch` stands against the profile's
        excess over K = 0 (`step_times`): the square of its measured steps there (decayed)
        over half a window, up to 1. Squared, a few probe steps barely move the floor (10
        of 100: 1% of the way from the floor to K's own time), and a K the probes alone
        measured does not beat K = 0 on noise (the floor's reason), while one that ran most
        of the way keeps most of its own time (70 of 100: 49%). A K never measured at that
        bucket has none. K = 0 has no floor to give way."""
        if k == 0:
            return 1.0
        rate = self.ratios.get(k, {}).get(batch_bucket(batch))
        steps = rate.trials if rate is not None else 0.0
        return min(steps / self.trusted_steps, 1.0) ** 2

    def trusted(self, k: int, batch: int) -> bool:
        """Whether K has run at the bucket of `batch` for half a window of measured steps
        (decayed): then its own time stands without the profile's excess as a floor."""
        return k > 0 and self.trust(k, batch) >= 1.0

    def weight(self, k: int, batch: int) -> float:
        """How many (decayed) steps measured K at the bucket of `batch`; an estimate
        borrowed from elsewhere counts as one step."""
        rate = self.ratios.get(k, {}).get(batch_bucket(batch))
        return max(rate.trials, 1.0) if rate is not None else 1.0


def monotone_fit(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool
    adjacent violators): wherever a value is below the one before it, the run is replaced
    by its weighted mean."""
    blocks: list[tuple[float, float, int]] = []  # (mean, weight, length)
    for value, weight in zip(values, weights, strict=True):
        mean, total, length = value, weight, 1
        while blocks and blocks[-1][0] > mean:
            before, before_weight, before_length = blocks.pop()
            mean = (before * before_weight + mean * total) / (before_weight + total)
            total += before_weight
            length += before_length
        blocks.append((mean, total, length))
    return [mean for mean, _, length in blocks for _ in range(length)]
