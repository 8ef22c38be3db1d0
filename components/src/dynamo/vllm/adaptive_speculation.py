"""The number of drafts K chosen online, each step, from what this worker measures.

The offline profile (`speculation_profile`) fixes K per batch size from acceptance on the
prompts it was profiled with and step times of an engine measured alone. Served traffic
differs from both: its prompts accept more or fewer drafts, and a step costs more when
the frontend, NATS and other processes share the cores. This module keeps two live
estimates and picks, for the batch about to run, the K with the highest goodput

    goodput(K, b) = b * (1 + d * sum(a_i for i < K)) / step(K, b)

* `a_i`, the per-position acceptance: the fraction of drafts that reached position i whose
  token i was accepted (vLLM's per-position rates), from decayed counts of the drafts and
  acceptances this worker verified. The profile's rates seed them as `warmup_drafts`
  drafts at every position, so a worker starts where the profile stands and follows live
  traffic as it comes. `d` is the fraction of sequence-steps that carried a draft (below 1
  for n-gram, which proposes nothing where the context has no match), estimated the same
  way.
* `step(K, b)`, the profile's step time corrected by this worker's own: a decayed ratio of
  measured to profiled time, one per K (a K not run lately borrows the mean ratio).

Two rules keep speculation from losing. K > 0 wins only when its goodput beats K = 0 by
`margin` (an estimate's noise must not cost throughput). And a K that is never chosen is
never measured, so after `probe_every` steps in a row at K = 0 one step drafts a single
token: acceptance that has risen brings K back, at the cost of one cheap draft in many.

Pure arithmetic on plain numbers (no vLLM import): the scheduler feeds it and asks it,
and the unit tests drive it with synthetic counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
"""Verification steps over which old counts fade to a third (decay 1 - 1/window)."""
DEFAULT_WARMUP_DRAFTS = 256
"""Drafts at each position the profile's acceptance counts as at start."""
DEFAULT_MARGIN = 0.03
"""Goodput a K > 0 must gain over K = 0, relative, to be chosen."""
DEFAULT_PROBE_EVERY = 50
"""Steps in a row at K = 0 after which one step drafts a token to re-measure acceptance."""
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

    positions: list[DecayedRate]
    drafted: DecayedRate
    decay: float

    @classmethod
    def from_profile(
        cls, acceptance: Sequence[float], drafted: float, settings: AdaptationSettings
    ) -> AcceptanceEstimate:
        weight = float(settings.warmup_drafts)
        return cls(
            positions=[DecayedRate(weight * rate, weight) for rate in acceptance],
            drafted=DecayedRate(weight * drafted, weight),
            decay=1.0 - 1.0 / settings.window_steps,
        )

    def observe(
        self,
        drafted_per_position: Sequence[int],
        accepted_per_position: Sequence[int],
        sequences_asked: int,
        sequences_drafted: int,
    ) -> None:
        """One verification step: drafts and acceptances at each position (summed over
        the batch), the sequences that were asked for drafts and those that got any."""
        for rate in self.positions:
            rate.fade(self.decay)
        self.drafted.fade(self.decay)
        for i, (drafts, accepted) in enumerate(
            zip(drafted_per_position, accepted_per_position, strict=True)
        ):
            if i < len(self.positions) and drafts > 0:
                self.positions[i].add(min(accepted, drafts), drafts)
        if sequences_asked > 0:
            self.drafted.add(min(sequences_drafted, sequences_asked), sequences_asked)

    def rates(self) -> list[float]:
        """a_i for every position; a rate never exceeds the one before it (a token counts
        only if every earlier one was accepted)."""
        out: list[float] = []
        for rate in self.positions:
            value = rate.rate(out[-1] if out else 0.0)
            out.append(min(value, out[-1]) if out else value)
        return out

    def drafted_fraction(self) -> float:
        return self.drafted.rate(1.0)

    def tokens_per_step(self, k: int) -> float:
        return 1.0 + self.drafted_fraction() * sum(self.rates()[:k])


@dataclass
class StepCost:
    """The profile's step time at (K, batch), corrected by measured steps."""

    profile: SpeculationProfile
    decay: float
    k0_ms: Sequence[float]  # what a step without drafting costs (the plain engine's)
    ratios: dict[int, DecayedRate] = field(default_factory=dict)

    def profiled_ms(self, k: int, batch: int) -> float:
        times = self.k0_ms if k == 0 else self.profile.times_for(k).step_ms
        return step_time(self.profile.batch_sizes, times, batch)

    def observe(self, k: int, batch: int, measured_ms: float) -> None:
        """One measured step that drafted `k` tokens for a batch of `batch`."""
        if measured_ms <= 0 or batch < 1:
            return
        low, high = RATIO_BOUNDS
        sample = min(max(measured_ms / self.profiled_ms(k, batch), low), high)
        ratio = self.ratios.setdefault(k, DecayedRate(0.0, 0.0))
        ratio.fade(self.decay)
        ratio.add(sample, 1.0)

    def correction(self, k: int) -> float:
        """Measured over profiled time for K (the mean over measured Ks where K has not
        been measured; 1 before any measurement)."""
        measured = [r for r in self.ratios.values() if r.trials > 1e-9]
        mean = sum(r.rate(1.0) for r in measured) / len(measured) if measured else 1.0
        own = self.ratios.get(k)
        return own.rate(mean) if own is not None else mean

    def step_ms(self, k: int, batch: int) -> float:
        return self.profiled_ms(k, batch) * self.correction(k)


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
        self.cost = StepCost(profile, decay, plain or profile.times_for(0).step_ms)
        self._steps_at_zero = 0

    def goodput(self, k: int, batch: int) -> float:
        """Expected tokens per second of the whole batch at K."""
        return batch * self.acceptance.tokens_per_step(k) * 1000.0 / self.cost.step_ms(k, batch)

    def best(self, batch: int) -> int:
        """The K with the highest goodput at `batch`; K > 0 must beat K = 0 by the margin,
        and the smaller K wins a tie."""
        if batch < 1:
            return 0
        floor = self.goodput(0, batch) * (1.0 + self.settings.margin)
        best_k, best_rate = 0, floor
        for k in range(1, self.max_k + 1):
            rate = self.goodput(k, batch)
            if rate > best_rate * (1.0 + 1e-9):
                best_k, best_rate = k, rate
        return best_k

    def choose(self, batch: int) -> int:
        """K for the next step of `batch` decoding sequences, probing after a long run
        at K = 0 (see the module)."""
        k = self.best(batch)
        if k > 0 or batch < 1:
            self._steps_at_zero = 0
            return k
        self._steps_at_zero += 1
        if self._steps_at_zero >= self.settings.probe_every:
            self._steps_at_zero = 0
            return 1
        return 0

    def observe_verification(
        self,
        drafted_per_position: Sequence[int],
        accepted_per_position: Sequence[int],
        sequences_asked: int,
        sequences_drafted: int,
    ) -> None:
        self.acceptance.observe(
            drafted_per_position, accepted_per_position, sequences_asked, sequences_drafted
        )

    def observe_step(self, k: int, batch: int, measured_ms: float) -> None:
        if self.settings.adapt_step_times:
            self.cost.observe(k, batch, measured_ms)


def engine_config(profile: Path, settings: AdaptationSettings, *, free_k0: bool) -> dict[str, Any]:
    """The entry of vLLM's `additional_config` that the adaptive scheduler reads."""
    return {
        ADDITIONAL_CONFIG_KEY: {"profile": str(profile), "free_k0": free_k0, **asdict(settings)}
    }


def chooser_from_engine_config(config: Mapping[str, Any], max_k: int) -> AdaptiveK:
    """The chooser `engine_config` describes, for an engine drafting at most `max_k`."""
    entry = dict(config)
    profile = load_profile(Path(entry.pop("profile")))
    free_k0 = bool(entry.pop("free_k0"))
    return AdaptiveK(profile, max_k, AdaptationSettings(**entry), free_k0=free_k0)
