"""Load-agnostic instance choice: round-robin and uniform random, written once.

Both the runtime's own `Client.round_robin` / `Client.random` and the LLM layer's
stateless routers pick through these, so there is one implementation of each policy.
Choosing is pure (no NATS): the caller passes the candidates it considers live.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence


class RoundRobin:
    """Each call takes the next candidate in turn (a shared counter over calls, so
    alternating requests spread evenly even as the candidate list changes)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[int]) -> int:
        if not candidates:
            raise ValueError("no candidate to pick from")
        return candidates[next(self._turn) % len(candidates)]


class RandomChoice:
    """Each call takes a uniformly random candidate."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[int]) -> int:
        if not candidates:
            raise ValueError("no candidate to pick from")
        return self._rng.choice(candidates)
