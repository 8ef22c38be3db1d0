"""How many draft tokens a simulated verification step accepts.

Speculative decoding proposes K draft tokens per step; the target model accepts a
*leading run* of them (draft i can only be kept if drafts 0..i-1 were) and always adds one
token of its own (the bonus token). So one step produces ``j + 1`` tokens, ``j in 0..K``.

The model here is a categorical distribution over ``j``, built either from

* per-position acceptance rates ``p_0..p_{K-1}``: ``p_i`` is the probability that draft
  ``i`` is accepted given that every draft before it was (one rate for all positions is
  the common "Bernoulli per position" model), so
  ``P(j) = p_0 ... p_{j-1} (1 - p_j)`` and ``P(K) = p_0 ... p_{K-1}``; or
* the distribution ``P(0..K)`` itself (e.g. a histogram measured on a real engine, as
  `SpecDecodeStats.acceptance_histogram` reports it).

One uniform draw per step picks ``j`` (inverse CDF), which keeps large simulated batches
cheap.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    """The distribution of accepted drafts per step for K speculative tokens."""

    probabilities: tuple[float, ...]  # P(j accepted), j = 0..K; sums to 1
    _cdf: tuple[float, ...] = field(init=False, repr=False, compare=False)

    @classmethod
    def none(cls) -> AcceptanceModel:
        """No speculation (K = 0): every step produces exactly one token."""
        return cls((1.0,))

    @classmethod
    def from_rates(cls, rates: Sequence[float], num_speculative_tokens: int) -> AcceptanceModel:
        """Per-position conditional acceptance rates; one rate applies to every position."""
        k = num_speculative_tokens
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        if k == 0:
            return cls.none()
        if len(rates) == 1:
            rates = list(rates) * k
        if len(rates) != k:
            raise ValueError(
                f"give 1 or {k} acceptance rates (one per draft position), got {len(rates)}"
            )
        for rate in rates:
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"acceptance rates must be in [0, 1], got {rate}")
        probabilities = []
        reach = 1.0  # probability that every draft before position i was accepted
        for rate in rates:
            probabilities.append(reach * (1.0 - rate))
            reach *= rate
        probabilities.append(reach)
        return cls(tuple(probabilities))

    @classmethod
    def from_distribution(
        cls, weights: Sequence[float], num_speculative_tokens: int
    ) -> AcceptanceModel:
        """``weights[j]`` ∝ probability of accepting exactly ``j`` drafts (K + 1 entries)."""
        k = num_speculative_tokens
        if len(weights) != k + 1:
            raise ValueError(
                f"an acceptance distribution for K={k} needs {k + 1} weights (j = 0..{k}), "
                f"got {len(weights)}"
            )
        if any(w < 0 for w in weights):
            raise ValueError("acceptance distribution weights must be >= 0")
        total = float(sum(weights))
        if total <= 0:
            raise ValueError("acceptance distribution weights must not all be 0")
        return cls(tuple(w / total for w in weights))

    def __post_init__(self) -> None:
        if not self.probabilities:
            raise ValueError("an acceptance model needs at least P(0)")
        object.__setattr__(self, "_cdf", tuple(_cumulative(self.probabilities)))

    @property
    def num_speculative_tokens(self) -> int:
        return len(self.probabilities) - 1

    @property
    def mean_acceptance_length(self) -> float:
        """Expected tokens per step, bonus token included: ``1 + E[j]``."""
        return 1.0 + sum(j * p for j, p in enumerate(self.probabilities))

    def per_position_rates(self) -> list[float]:
        """Unconditional probability that the draft at each position is accepted,
        ``P(j > i)``: what vLLM's per-position acceptance metric measures."""
        tail = 1.0
        rates = []
        for p in self.probabilities[:-1]:
            tail -= p
            rates.append(max(tail, 0.0))
        return rates

    def sample(self, rng: random.Random) -> int:
        """Draws ``j``, the number of drafts accepted in one step."""
        if len(self.probabilities) == 1:
            return 0
        cdf = self._cdf
        return min(bisect.bisect_right(cdf, rng.random()), len(cdf) - 1)


def _cumulative(probabilities: Sequence[float]) -> list[float]:
    total = 0.0
    cdf = []
    for p in probabilities:
        total += p
        cdf.append(total)
    return cdf


@dataclass(frozen=True, slots=True)
class AcceptanceChange:
    """From `after_s` seconds after the engine started, drafts are accepted by `model`
    (`--acceptance-rate-after`): a workload whose mix drifts, e.g. for the planner's
    capacity model to follow."""

    after_s: float
    model: AcceptanceModel


def acceptance_at(
    initial: AcceptanceModel, changes: Sequence[AcceptanceChange], elapsed_s: float
) -> AcceptanceModel:
    """The model in force `elapsed_s` seconds after the start (`changes` by time)."""
    current = initial
    for change in changes:
        if change.after_s > elapsed_s:
            break
        current = change.model
    return current
