"""The live acceptance estimate of adaptive speculation (`speculative.adaptive_k`): the
per-position acceptance kept as decayed conditional rates, and the fraction of
sequence-steps that carried a draft, warm-started from a profile."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True)
class VerificationStep:
    """One verification step, summed over the batch: at each position, the drafts that
    reached it with every earlier token accepted, and those whose token there was accepted
    too; the sequences that were asked for drafts and those that got any."""

    reached_per_position: Sequence[int]
    accepted_per_position: Sequence[int]
    sequences_asked: int
    sequences_drafted: int

    def one_draft_tokens(self) -> float | None:
        """Tokens per sequence-step had each sequence drafted one token, accepted as often
        as the first position was in this step alone; None when no sequence was asked."""
        if self.sequences_asked <= 0:
            return None
        reached = self.reached_per_position[0] if self.reached_per_position else 0
        first = min(self.accepted_per_position[0], reached) / reached if reached else 0.0
        drafted = min(self.sequences_drafted, self.sequences_asked) / self.sequences_asked
        return 1.0 + drafted * first


@dataclass
class AcceptanceEstimate:
    """Per-position acceptance and the drafted fraction, warm-started from a profile."""

    conditional: list[DecayedRate]
    drafted: DecayedRate
    decay: float

    @classmethod
    def from_profile(
        cls, acceptance: Sequence[float], drafted: float, *, warmup_drafts: int, window_steps: int
    ) -> AcceptanceEstimate:
        """Seeded with the profile's rates as `warmup_drafts` drafts at every position;
        counts fade to a third over `window_steps` steps."""
        weight = float(warmup_drafts)
        return cls(
            conditional=[DecayedRate(weight * c, weight) for c in conditional_rates(acceptance)],
            drafted=DecayedRate(weight * drafted, weight),
            decay=1.0 - 1.0 / window_steps,
        )

    def observe(self, step: VerificationStep) -> None:
        """Count one verification step (after fading the older ones)."""
        self.fade()
        for i, (reached, accepted) in enumerate(
            zip(step.reached_per_position, step.accepted_per_position, strict=True)
        ):
            if i < len(self.conditional) and reached > 0:
                self.conditional[i].add(min(accepted, reached), reached)
        asked = step.sequences_asked
        if asked > 0:
            self.drafted.add(min(step.sequences_drafted, asked), asked)

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
