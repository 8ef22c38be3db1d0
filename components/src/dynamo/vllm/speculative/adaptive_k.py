"""The number of drafts K chosen online, each step, from what this worker measures.

The offline profile (`dynamo.llm.speculation_profile`) fixes K per batch size from acceptance on the
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

The two estimates live in modules of their own: `speculative.acceptance`
(`AcceptanceEstimate`) and `speculative.step_cost` (`StepCost`). All three are pure
arithmetic on plain numbers (no vLLM import): the scheduler feeds them and asks the
chooser, and the unit tests drive it with synthetic counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dynamo.llm.speculation_profile import SpeculationProfile, load_profile
from dynamo.vllm.speculative.acceptance import AcceptanceEstimate, VerificationStep
from dynamo.vllm.speculative.step_cost import StepCost

SCHEDULER_CLS = "dynamo.vllm.speculative.scheduler.AdaptiveSpeculationScheduler"
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
            profile.acceptance_per_position[: self.max_k],
            profile.drafted_fraction,
            warmup_drafts=self.settings.warmup_drafts,
            window_steps=self.settings.window_steps,
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
        if self.cost.trust(up, batch) == 0.0:  # not measured at `batch`
            return False
        own = self.cost.fitted_times(batch, up)[up]
        goodput_up = batch * self.acceptance.tokens_per_step(up) * 1000.0 / own
        return goodput_up > self.goodput(k, batch) * (1.0 + self.settings.margin)

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
        """See `VerificationStep`; the step alone also decides `_last_step_pays`."""
        step = VerificationStep(
            reached_per_position, accepted_per_position, sequences_asked, sequences_drafted
        )
        tokens = step.one_draft_tokens()
        if tokens is not None:
            self._last_tokens_per_step = tokens
        self.acceptance.observe(step)

    def observe_step(self, k: int, batch: int, measured_ms: float) -> None:
        if self.settings.adapt_step_times:
            self.cost.observe(k, batch, measured_ms)


def engine_config(
    profile: Path, settings: AdaptationSettings, *, free_k0: bool, state_path: Path
) -> dict[str, Any]:
    """The entry of vLLM's `additional_config` that the adaptive scheduler reads:
    `state_path` is where it shares the K in force with the worker (`speculative.k_in_force`)."""
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
