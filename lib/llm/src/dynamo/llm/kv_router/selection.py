"""Choosing one worker among scored candidates, and the records that choice leaves.

`KvScheduler` computes each candidate's cost from its books; what happens next needs
none of them: `choose` takes the lowest cost (temperature 0, ties at random) or samples
from `softmax_weights`, and `WorkerScore`, `RoutingDecision` and `RoutingTally` keep the
terms of that choice for logging, metrics and tests. Kept apart from the scheduler so
the selection arithmetic is plain values in, value out, and is read and tested alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerScore:
    """The terms of one worker's cost, kept for logging, metrics and tests.

    `overlap_blocks` counts the leading prompt blocks in the worker's device tier (cached
    or about to be); the matched prefix may go on through blocks held only in an offload
    tier (`host_blocks`, `disk_blocks`), which the cost counts at their tier's weight:
    ``prefill_blocks = request blocks - weighted_overlap`` (`tiers`)."""

    worker_id: int
    overlap_blocks: int
    prefill_blocks: float
    active_blocks: int  # with the request added, speculative slots included
    num_speculative_tokens: int
    cost: float
    cached_blocks: int = 0  # of overlap_blocks, those the worker's events reported stored
    weighted_overlap: float = 0.0  # matched blocks, each at its tier's weight
    host_blocks: int = 0  # matched past overlap_blocks and held on host memory, not device
    disk_blocks: int = 0  # the same, held on disk only


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """The chosen worker and why."""

    worker_id: int
    overlap_blocks: int
    request_blocks: int
    scores: tuple[WorkerScore, ...]


@dataclass(slots=True)
class RoutingTally:
    """What the router sent one worker: requests, their blocks, and the blocks it
    expected to find cached there (the predicted prefix-cache hit rate: device tier;
    the blocks to be loaded back from an offload tier are counted apart)."""

    requests: int = 0
    request_blocks: int = 0
    overlap_blocks: int = 0
    host_blocks: int = 0
    disk_blocks: int = 0

    def add(self, decision: RoutingDecision) -> None:
        self.requests += 1
        self.request_blocks += decision.request_blocks
        self.overlap_blocks += decision.overlap_blocks
        chosen = next((s for s in decision.scores if s.worker_id == decision.worker_id), None)
        if chosen is not None:
            self.host_blocks += chosen.host_blocks
            self.disk_blocks += chosen.disk_blocks

    @classmethod
    def sum(cls, tallies: Iterable[RoutingTally]) -> RoutingTally:
        """The tallies added up (what the router sent all workers)."""
        total = cls()
        for tally in tallies:
            for counter in fields(cls):
                name = counter.name
                setattr(total, name, getattr(total, name) + getattr(tally, name))
        return total

    @property
    def hit_rate(self) -> float:
        """Predicted fraction of prompt blocks served from cache."""
        return self.overlap_blocks / self.request_blocks if self.request_blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "request_blocks": self.request_blocks,
            "overlap_blocks": self.overlap_blocks,
            "host_blocks": self.host_blocks,
            "disk_blocks": self.disk_blocks,
            "hit_rate": round(self.hit_rate, 4),
        }


def choose(scores: Sequence[WorkerScore], temperature: float, rng: random.Random) -> WorkerScore:
    """Lowest cost at temperature 0 (random among ties), otherwise softmax sampling over
    negative costs normalised to [0, 1] so the temperature means the same at any load."""
    if not scores:
        raise ValueError("no worker to choose from")
    if temperature <= 0:
        best = min(score.cost for score in scores)
        return rng.choice([score for score in scores if score.cost == best])
    weights = softmax_weights([score.cost for score in scores], temperature)
    return rng.choices(scores, weights=weights, k=1)[0]


def softmax_weights(costs: Sequence[float], temperature: float) -> list[float]:
    """Selection probabilities ``softmax(-(c - min) / (max - min) / temperature)``.

    Costs are min-max normalised first: raw costs grow with load, and without the
    normalisation the same temperature would mean "nearly argmin" on a busy cluster and
    "nearly uniform" on an idle one. Equal costs give a uniform distribution.
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    low, high = min(costs), max(costs)
    span = high - low
    if span <= 0:
        return [1.0 / len(costs)] * len(costs)
    exps = [math.exp(-((cost - low) / span) / temperature) for cost in costs]
    total = sum(exps)
    return [value / total for value in exps]
