"""Model cards the frontend could not load yet, and when to try each again.

Loading a card can fail for reasons that pass: the tokenizer files are not in the object
store yet (a broker restarted without its store, and the worker has not re-uploaded
them), the broker is briefly away while the KV router subscribes, ... A card is put
once and then only heartbeated with the same value, so no new event would ever bring a
failed card back: without a retry its worker stayed hidden for its whole life.
`CardRetries` is the bookkeeping (which card, how many failures, when next), with an
injected clock; `ModelCardSync` (`card_sync.py`) does the loading.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dynamo.llm.model_card import card_key
from dynamo.llm.protocols import ModelCard
from dynamo.runtime.backoff import Backoff

Clock = Callable[[], float]


@dataclass
class PendingCard:
    """A card whose last load failed."""

    card: ModelCard
    failures: int
    due: float  # clock reading at which to try again


class CardRetries:
    """Failed cards by registry key, each due again after `backoff.delay(failures)`."""

    def __init__(self, backoff: Backoff | None = None, clock: Clock = time.monotonic) -> None:
        self.backoff = backoff or Backoff()
        self._clock = clock
        self._pending: dict[str, PendingCard] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, card: object) -> bool:
        return isinstance(card, ModelCard) and card_key(card) in self._pending

    def failed(self, card: ModelCard) -> PendingCard:
        """Loading `card` failed again (or for the first time): schedule the next try.
        A card that changed since its last failure (re-published differently) starts
        over with the shortest delay."""
        key = card_key(card)
        known = self._pending.get(key)
        failures = known.failures + 1 if known is not None and known.card == card else 1
        pending = PendingCard(card, failures, self._clock() + self.backoff.delay(failures))
        self._pending[key] = pending
        return pending

    def forget(self, card: ModelCard) -> None:
        """`card` loaded, or went away: no more retries."""
        self._pending.pop(card_key(card), None)

    def due(self) -> list[ModelCard]:
        """Cards whose next try is due now, earliest first (they stay pending until
        `failed` or `forget` is called for them)."""
        now = self._clock()
        ready = sorted((p for p in self._pending.values() if p.due <= now), key=lambda p: p.due)
        return [p.card for p in ready]

    def seconds_until_next(self) -> float | None:
        """Seconds until the earliest try (0 when one is due; None when nothing waits)."""
        if not self._pending:
            return None
        earliest = min(p.due for p in self._pending.values())
        return max(0.0, earliest - self._clock())

    def hurry(self) -> None:
        """The broker is back (a reconnect): what failed during the outage may work now,
        so every pending card starts over with the shortest delay."""
        soon = self._clock() + self.backoff.delay(1)
        for key, pending in list(self._pending.items()):
            self._pending[key] = PendingCard(pending.card, 0, min(pending.due, soon))
