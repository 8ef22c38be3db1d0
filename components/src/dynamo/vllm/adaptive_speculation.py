"""The number of drafts K chosen online, each step, from what this worker measures.

The offline profile (`speculation_profile`) fixes K per batch size from acceptance on the
prompts it was profiled with and step times of an engine measured alone. Served traffic
differs from both: its prompts accept more or fewer drafts, and a step costs more when
the frontend, NATS and other processes share the cores. This module keeps two live
estimates and picks, for the batch about to run, the K with the highest goodput

    goodput(K, b) = b * (1 + d * sum(a_i for i < K)) / step(K, b)

* `a_i`, the per-position acceptance (vLLM's per-position rate: the fraction of drafts
  whose token i was accepted), kept as a product of conditional rates: `c_i`, the
  fraction of drafts that reached position i with every earlier token accepted whose
  token i was accepted too, from decayed counts of what this worker verified. A position
  that the K in force has not reached lately keeps its last conditional rate, and its
  `a_i` still follows the earlier positions: when traffic turns predictable while K is 1,
  position 0's rise lifts positions 1 and 2 with it (kept as plain rates, a position not
  drafted would stay where the last traffic left it, and K would stay at 1). The
  profile's rates seed the conditional ones as `warmup_drafts` drafts at every position,
  so a worker starts where the profile stands and follows live traffic as it comes. `d`
  is the fraction of sequence-steps that carried a draft (below 1 for n-gram, which
  proposes nothing where the context has no match), estimated the same way.
* `step(K, b)`, the profile's step time corrected by this worker's own: a decayed ratio of
  measured to profiled time per K and batch-size bucket (powers of two), since what a
  served step adds to the profile's grows with the batch (a quick n-gram run measured
  1.09x at K = 0 and 1.14-1.24x at K = 1 over all batches, and K = 1 kept winning at 16
  to 64 sequences where it lost). A drafting K not measured at a bucket where K = 0 was
  takes K = 0's ratio there times its own excess over K = 0 at the nearest bucket where
  both ran (served drafting costs more relative to K = 0 as the batch grows, so its own
  ratio from a smaller batch would make it look cheap); otherwise a bucket not measured
  yet takes the ratio of the nearest bucket measured at that K; a K not run lately
  borrows the mean ratio.

Two rules keep speculation from losing. K > 0 wins only when its goodput beats K = 0 by
`margin` (an estimate's noise must not cost throughput). And a K that is never chosen is
never measured, so after `probe_every` steps in a row at K = 0 one step drafts a single
token: acceptance that has risen brings K back, at the cost of one cheap draft in many
(steps at K = 1 go on while each pays by itself, until the estimate has caught up).
The window counts decoding steps, those at K = 0 included, so by the time a probe runs
the acceptance measured before it has faded, and the probe speaks for today's traffic.
The other way round, with step times adapting, `probe_every` steps in a row that draft
are followed by two at K = 0 (the second verifies nothing and drafts nothing, a clean
measurement): K = 0 is then priced by served measurement like the Ks that run, not at
the profile's price beside Ks that carry their served correction. Every other such run,
below the largest K, is followed instead by UPWARD_STEPS at the next K up (the first
verifies the smaller K's drafts, the others are clean measurements): a K that is never
chosen is never measured, and a larger K priced from steps at another batch size can
look dear where it is cheap (seen: Eagle3 at one sequence held at K = 1, 1.14x no
speculation, its K = 3 priced from a few warm-up steps at 4 sequences at 1.29x the
profile where served it costs 0.76x, and a static K = 3 served 1.44x). K climbs one
step per probe while each pays. A probed K whose own measured time pays goes on after
its UPWARD_STEPS, each step measured, until `best` takes it or its time stops paying:
priced with the floor (`StepCost.step_times`), it would otherwise gather its steps only
from the probes, a few in a hundred, and never be trusted.

Pure arithmetic on plain numbers (no vLLM import): the scheduler feeds it and asks it,
and the unit tests drive it with synthetic counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynamo.vllm.speculation_profile import SpeculationProfile, load_profile, step_time

SCHEDULER_CLS = "dynamo.vllm.adaptive_scheduler.AdaptiveSpeculationScheduler"
"""vLLM's `--scheduler-cls` for an adaptive worker (resolved inside the engine core)."""
ADDITIONAL_CONFIG_KEY = "dynamo_adaptive_speculation"
"""Where the worker puts the chooser's settings in vLLM's `additional_config`."""
ADAPT_MODES = ("off", "acceptance", "full")

DEFAULT_WINDOW_STEPS = 200
"""Decoding steps over which old counts fade to a third (decay 1 - 1/window)."""
DEFAULT_WARMUP_DRAFTS = 256
"""Drafts at each position the profile's acceptance counts as at start."""
DEFAULT_MARGIN = 0.03
"""Goodput a K > 0 must gain over K = 0, relative, to be chosen."""
DEFAULT_PROBE_EVERY = 50
"""Steps in a row at K = 0 after which one step drafts a token to re-measure acceptance;
with step times adapting, also steps in a row that draft after which two run at K = 0 to
re-measure what a step without drafts costs."""
BASELINE_STEPS = 2
"""Steps at K = 0 that re-measure its cost: the first still verifies the drafts before it."""
UPWARD_STEPS = 3
"""Steps at the next K up that measure it where it was not chosen: the first still
verifies the smaller K's drafts, the other two are measured."""
RATIO_BOUNDS = (0.25, 4.0)
"""A measured step further than this from the profile's (as a ratio) counts at the bound:
one stall, the machine busy with something else, must not decide for a whole window."""


class AdaptationError(ValueError):
    """Settings the chooser cannot work with."""


@dataclass(frozen=True)
class AdaptationSettings:
    window_steps: int = DEFAULT_WINDOW_STEPS
    warmup_drafts: int = DEFAULT_WARMUP_DRAFTS
    margin: float = DEFAULT_MARGIN
    probe_every: int = DEFAULT_PROBE_EVERY
    adapt_step_times: bool = True  # False: acceptance adapts, step times are the profile's

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise AdaptationError(f"the window must be at least 1 step, got {self.window_steps}")
        if self.warmup_drafts < 0:
            raise AdaptationError(f"warm-up drafts cannot be negative, got {self.warmup_drafts}")
        if not 0.0 <= self.margin < 1.0:
            raise AdaptationError(f"the margin must be in [0, 1), got {self.margin}")
        if self.probe_every < 1:
            raise AdaptationError(f"probe_every must be at least 1, got {self.probe_every}")


@dataclass
class DecayedRate:
    """A rate from counts that fade by `decay` each time `fade` is called."""

    hits: float
    trials: float

    def add(self, hits: float, trials: float) -> None:
        self.hits += hits
        self.trials += trials

    def fade(self, decay: float) -> None:
        self.hits *= decay
        self.trials *= decay

    def rate(self, default: float) -> float:
        return self.hits / self.trials if self.trials > 1e-9 else default


@dataclass
class AcceptanceEstimate:
    """Per-position acceptance and the drafted fraction, warm-started from a profile."""

    conditional: list[DecayedRate]
    drafted: DecayedRate
    decay: float

    @classmethod
    def from_profile(
        cls, acceptance: Sequence[float], drafted: float, settings: AdaptationSettings
    ) -> AcceptanceEstimate:
        weight = float(settings.warmup_drafts)
        return cls(
            conditional=[DecayedRate(weight * c, weight) for c in conditional_rates(acceptance)],
            drafted=DecayedRate(weight * drafted, weight),
            decay=1.0 - 1.0 / settings.window_steps,
        )

    def observe(
        self,
        reached_per_position: Sequence[int],
        accepted_per_position: Sequence[int],
        sequences_asked: int,
        sequences_drafted: int,
    ) -> None:
        """One verification step, summed over the batch: at each position, the drafts that
        reached it with every earlier token accepted, and those whose token there was
        accepted too; the sequences that were asked for drafts and those that got any."""
        self.fade()
        for i, (reached, accepted) in enumerate(
            zip(reached_per_position, accepted_per_position, strict=True)
        ):
            if i < len(self.conditional) and reached > 0:
                self.conditional[i].add(min(accepted, reached), reached)
        if sequences_asked > 0:
            self.drafted.add(min(sequences_drafted, sequences_asked), sequences_asked)

    def fade(self) -> None:
        """One decoding step has passed: older counts weigh less."""
        for rate in self.conditional:
            rate.fade(self.decay)
        self.drafted.fade(self.decay)

    def rates(self) -> list[float]:
        """a_i for every position: the product of the conditional rates up to it. A
        position never measured (no warm-up, no traffic) borrows the conditional rate
        before it; position 0 unmeasured assumes no gain."""
        out: list[float] = []
        product, previous = 1.0, 0.0
        for rate in self.conditional:
            previous = min(max(rate.rate(previous), 0.0), 1.0)
            product *= previous
            out.append(product)
        return out

    def drafted_fraction(self) -> float:
        return self.drafted.rate(1.0)

    def tokens_per_step(self, k: int) -> float:
        return 1.0 + self.drafted_fraction() * sum(self.rates()[:k])


def conditional_rates(acceptance: Sequence[float]) -> list[float]:
    """vLLM's per-position rates (a_i) as conditional ones (a_i / a_(i-1)); where an
    earlier rate is 0 the ratio is unknown and the conditional rate before it stands in."""
    out: list[float] = []
    before = 1.0
    for rate in acceptance:
        if before > 0.0:
            out.append(min(max(rate / before, 0.0), 1.0))
        else:
            out.append(out[-1] if out else 0.0)
        before = rate
    return out


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
    trusted_steps: float = DEFAULT_WINDOW_STEPS / 2
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


class AdaptiveK:
    """Chooses K for each step; fed verification counts and measured step times."""

    def __init__(
        self,
        profile: SpeculationProfile,
        max_k: int,
        settings: AdaptationSettings | None = None,
        *,
        free_k0: bool = True,
    ) -> None:
        """`max_k`: the engine's `num_speculative_tokens` (K never exceeds it, nor the
        profile's largest K). `free_k0`: a step at K = 0 runs no drafter, so it costs what
        the plain engine's does (the profile's `no_speculation_step_ms`); otherwise the
        profile's K = 0 on the speculating engine."""
        self.settings = settings or AdaptationSettings()
        self.max_k = min(max_k, profile.max_k)
        if self.max_k < 1:
            raise AdaptationError(f"nothing to adapt: at most K={self.max_k}")
        decay = 1.0 - 1.0 / self.settings.window_steps
        self.acceptance = AcceptanceEstimate.from_profile(
            profile.acceptance_per_position[: self.max_k], profile.drafted_fraction, self.settings
        )
        plain = profile.no_speculation_step_ms if free_k0 else []
        self.cost = StepCost(
            profile,
            decay,
            plain or profile.times_for(0).step_ms,
            trusted_steps=self.settings.window_steps / 2,
        )
        self._steps_at_zero = 0
        self._steps_drafting = 0
        self._baseline_left = 0  # steps at K = 0 still to run to measure it
        self._upward_left = 0  # steps at `_upward_k` still to run to measure it
        self._upward_k = 0
        self._upward_next = False  # the next run of drafting steps ends with an upward probe
        self._last_tokens_per_step: float | None = None
        """Tokens per sequence-step one draft gave in the last verified step."""

    def goodput(self, k: int, batch: int) -> float:
        """Expected tokens per second of the whole batch at K."""
        return self.goodputs(batch)[k]

    def goodputs(self, batch: int) -> list[float]:
        """`goodput` at every K from 0 to `max_k`, the step times fitted once."""
        times = self.cost.step_times(batch)
        return [
            batch * self.acceptance.tokens_per_step(k) * 1000.0 / times[k]
            for k in range(self.max_k + 1)
        ]

    def best(self, batch: int) -> int:
        """The K with the highest goodput at `batch`; K > 0 must beat K = 0 by the margin,
        and the smaller K wins a tie."""
        if batch < 1:
            return 0
        rates = self.goodputs(batch)
        best_k, best_rate = 0, rates[0] * (1.0 + self.settings.margin)
        for k in range(1, self.max_k + 1):
            rate = rates[k]
            if rate > best_rate * (1.0 + 1e-9):
                best_k, best_rate = k, rate
        return best_k

    def choose(self, batch: int) -> int:
        """K for the next step of `batch` decoding sequences, probing after a long run
        at K = 0 (see the module)."""
        k = self.best(batch)
        if batch < 1:
            return k
        if k > 0:
            self._steps_at_zero = 0
            return self._drafting(k, batch)
        if self._last_step_pays(batch):
            return 1  # the probe, or the steps since, found drafts worth it: go on looking
        self._last_tokens_per_step = None
        # A step without drafts measures nothing, but it is a step of the window: what was
        # measured before fades, so that the next probe speaks for the traffic of now.
        self.acceptance.fade()
        self._steps_at_zero += 1
        if self._steps_at_zero >= self.settings.probe_every:
            self._steps_at_zero = 0
            return 1
        return 0

    def _drafting(self, k: int, batch: int) -> int:
        """`k`, unless the steps that draft have run `probe_every` in a row with step times
        adapting: then BASELINE_STEPS at K = 0, to measure it by the same clock, or, every
        other time and below the largest K, UPWARD_STEPS at K + 1, continued for as long
        as its own measured time pays (`_upward_pays`; see the module)."""
        if self._baseline_left > 0:
            self._baseline_left -= 1
            return 0
        if self._upward_left > 0:
            self._upward_left -= 1
            return self._upward_k
        if self._upward_k > k and self._upward_pays(k, batch):
            return self._upward_k
        self._upward_k = 0
        self._steps_drafting += 1
        if self.settings.adapt_step_times and self._steps_drafting >= self.settings.probe_every:
            self._steps_drafting = 0
            if self._upward_next and k < self.max_k:
                self._upward_next = False
                self._upward_k, self._upward_left = k + 1, UPWARD_STEPS
            else:
                self._upward_next = True
                self._baseline_left = BASELINE_STEPS
        return k

    def _upward_pays(self, k: int, batch: int) -> bool:
        """Whether the K of the upward probe just run, priced at its own measured time at
        `batch` (no floor of the profile's excess over K = 0), beats the chosen `k` by the
        margin. Its floor gives way only as its own steps add up, and a probe gives it
        UPWARD_STEPS in a hundred: Eagle3's K = 2 at one sequence measured 0.68x the
        profile, cheaper than K = 1, and stayed held to the profile's excess (1.33x K = 0
        where served it is about 1.09x) while K = 1 served 0.93x what the profiled K = 3
        did. Going on while its steps pay, the probed K gathers them until its floor has
        given way and `best` takes it, or its measured time stops paying."""
        up = self._upward_k
        if up > self.max_k or self.cost.trust(up, batch) == 0.0:  # not measured at `batch`
            return False
        own = self.cost.fitted_times(batch, up)[up]
        rate_up = self.acceptance.tokens_per_step(up) / own
        rate_k = self.acceptance.tokens_per_step(k) / self.cost.step_times(batch)[k]
        return rate_up > rate_k * (1.0 + self.settings.margin)

    def _last_step_pays(self, batch: int) -> bool:
        """Whether one draft, accepted as often as in the last verified step alone,
        would beat K = 0 by the margin at `batch`. A probe's few drafts weigh little
        against the window's counts, so while the estimate still says K = 0, steps at
        K = 1 go on as long as each one pays by itself; their drafts bring the estimate
        up within a window, or a step that does not pay ends the run."""
        tokens = self._last_tokens_per_step
        if tokens is None:
            return False
        times = self.cost.step_times(batch)
        one_draft = batch * tokens * 1000.0 / times[1]
        without = batch * self.acceptance.tokens_per_step(0) * 1000.0 / times[0]
        return one_draft > without * (1.0 + self.settings.margin)

    def observe_verification(
        self,
        reached_per_position: Sequence[int],
        accepted_per_position: Sequence[int],
        sequences_asked: int,
        sequences_drafted: int,
    ) -> None:
        """See `AcceptanceEstimate.observe`."""
        if sequences_asked > 0:
            reached = reached_per_position[0] if reached_per_position else 0
            first = min(accepted_per_position[0], reached) / reached if reached else 0.0
            drafted = min(sequences_drafted, sequences_asked) / sequences_asked
            self._last_tokens_per_step = 1.0 + drafted * first
        self.acceptance.observe(
            reached_per_position, accepted_per_position, sequences_asked, sequences_drafted
        )

    def observe_step(self, k: int, batch: int, measured_ms: float) -> None:
        if self.settings.adapt_step_times:
            self.cost.observe(k, batch, measured_ms)


def engine_config(
    profile: Path, settings: AdaptationSettings, *, free_k0: bool, state_path: Path
) -> dict[str, Any]:
    """The entry of vLLM's `additional_config` that the adaptive scheduler reads:
    `state_path` is where it shares the K in force with the worker (`speculation_state`)."""
    return {
        ADDITIONAL_CONFIG_KEY: {
            "profile": str(profile),
            "free_k0": free_k0,
            "state_path": str(state_path),
            **asdict(settings),
        }
    }


def adaptive_entry(additional_config: object) -> Mapping[str, Any] | None:
    """The adaptive scheduler's entry in vLLM's `additional_config`; None where the engine
    does not adapt."""
    if not isinstance(additional_config, Mapping):
        return None
    entry = additional_config.get(ADDITIONAL_CONFIG_KEY)
    return entry if isinstance(entry, Mapping) else None


def state_path_of(config: Mapping[str, Any]) -> Path:
    """Where the engine config's scheduler shares the K in force."""
    return Path(config["state_path"])


def chooser_from_engine_config(config: Mapping[str, Any], max_k: int) -> AdaptiveK:
    """The chooser `engine_config` describes, for an engine drafting at most `max_k`."""
    entry = dict(config)
    profile = load_profile(Path(entry.pop("profile")))
    free_k0 = bool(entry.pop("free_k0"))
    entry.pop("state_path")
    return AdaptiveK(profile, max_k, AdaptationSettings(**entry), free_k0=free_k0)
