"""Exponential backoff for work that must eventually succeed once NATS is back.

After a broker restart several things have to be redone by whoever noticed first (a
tokenizer download, a re-upload, a resubscription), and the broker may not be ready for
all of them at once. Retrying at a fixed short interval floods a recovering broker and
logs; giving up after one failure hides a worker or a model forever. `Backoff` is the
schedule (0.5 s, doubling, capped at 10 s by default) and `retry_until_done` the loop
that applies it to one async action.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_INITIAL_S = 0.5
DEFAULT_MAXIMUM_S = 10.0


@dataclass(frozen=True)
class Backoff:
    """Delay before retry number `attempt` (1-based): `initial_s * factor**(attempt-1)`,
    never more than `maximum_s`."""

    initial_s: float = DEFAULT_INITIAL_S
    maximum_s: float = DEFAULT_MAXIMUM_S
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.maximum_s < self.initial_s or self.factor < 1:
            raise ValueError(
                f"backoff needs 0 < initial_s <= maximum_s and factor >= 1, got {self}"
            )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after the `attempt`-th consecutive failure."""
        if attempt < 1:
            raise ValueError(f"attempt counts from 1, got {attempt}")
        # Step by step: a long outage's attempt count never builds a huge power.
        delay = self.initial_s
        for _ in range(attempt - 1):
            delay *= self.factor
            if delay >= self.maximum_s:
                return self.maximum_s
        return min(delay, self.maximum_s)


async def retry_until_done(
    action: Callable[[], Awaitable[T]],
    *,
    what: str,
    backoff: Backoff | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> T:
    """`await action()` until it returns, sleeping `backoff.delay(n)` after the n-th
    failure. Every failure is logged (warning) with `what`, the error and the next delay;
    cancellation is the only way out besides success."""
    schedule = backoff or Backoff()
    attempt = 0
    while True:
        try:
            return await action()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            attempt += 1
            delay = schedule.delay(attempt)
            log.warning(
                "%s failed (attempt %d): %s; retrying in %.1fs",
                what,
                attempt,
                exc or type(exc).__name__,
                delay,
            )
            await sleep(delay)
