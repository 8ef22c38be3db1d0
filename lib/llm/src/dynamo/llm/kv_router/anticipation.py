"""Blocks the router expects a worker to cache, before (or without) its events saying so.

When the router sends a request to a worker, that worker is about to compute the prompt's
blocks and keep them in its prefix cache. Its `BlockStored` events say so only after the
prefill, and they reach the router later still (the worker's relay, NATS, the feed): a
request of the same prefix routed in that window would find no overlap anywhere and might
go to another worker, which then computes the prefix a second time. So the router writes
down its own decision: the prompt's full blocks count as "will be cached" on the chosen
worker until

- the worker's events confirm them (the indexer has them from then on),
- the request ends before its first output (failed, cancelled, refused: the worker may
  never have computed them), unless another request in flight there holds them, or
- `ttl_s` passes (an event lost, a cache that evicted them at once).

Without events at all (`--no-kv-events`, or engines that publish none) the same book, with
a longer TTL and nothing to confirm it, is the whole index: the approximate mode Dynamo
also offers, where a worker is assumed to keep what it was sent for `ttl_s`.

Entries of one worker are kept in expiry order (one TTL for all, so insertion order), and
expired ones are dropped from the front as time moves: O(1) amortised per block.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

DEFAULT_ANTICIPATION_TTL_S = 10.0
"""How long routed blocks count as coming when no event confirms them (events mode)."""
DEFAULT_APPROXIMATE_TTL_S = 120.0
"""How long routed blocks count as cached in approximate mode (no events): Dynamo's
default for its approximate router as well."""


class AnticipatedBlocks:
    """Per worker, block hashes the router routed there and no event has confirmed yet."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.ttl_s = ttl_s
        self._clock = clock
        self._expiry: dict[int, OrderedDict[int, float]] = {}
        self.added = 0  # blocks written down (a re-routed block counts again)
        self.confirmed = 0  # removed because an event stored them
        self.dropped = 0  # removed because their request ended before its first output
        self.expired = 0  # removed because nothing confirmed them within the TTL

    def add(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """`worker_id` was sent a prompt of these blocks: they count from now for `ttl_s`."""
        expiry = self._clock() + self.ttl_s
        book = self._expiry.setdefault(worker_id, OrderedDict())
        for block_hash in block_hashes:
            book[block_hash] = expiry
            book.move_to_end(block_hash)
            self.added += 1

    def confirm(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """The worker's events stored these blocks: the index has them now."""
        self.confirmed += self._remove(worker_id, block_hashes)

    def drop(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """The request that brought these blocks ended before computing them."""
        self.dropped += self._remove(worker_id, block_hashes)

    def remove_worker(self, worker_id: int) -> None:
        self._expiry.pop(worker_id, None)

    def extend_prefix(self, worker_id: int, block_hashes: Sequence[int], start: int) -> int:
        """How many leading blocks of `block_hashes` the worker has or will have, given that
        it already has the first `start`: `start` plus the anticipated blocks that follow
        on without a gap."""
        book = self._live(worker_id)
        matched = start
        if book:
            while matched < len(block_hashes) and block_hashes[matched] in book:
                matched += 1
        return matched

    def block_count(self, worker_id: int) -> int:
        book = self._live(worker_id)
        return len(book) if book else 0

    def workers(self) -> list[int]:
        return [w for w in self._expiry if self.block_count(w)]

    def stats(self) -> dict[str, float]:
        return {
            "ttl_s": self.ttl_s,
            "blocks": sum(self.block_count(worker_id) for worker_id in list(self._expiry)),
            "added": self.added,
            "confirmed": self.confirmed,
            "dropped": self.dropped,
            "expired": self.expired,
        }

    def _remove(self, worker_id: int, block_hashes: Iterable[int]) -> int:
        """Forget these blocks on the worker; how many were written down."""
        book = self._expiry.get(worker_id)
        if not book:
            return 0
        return sum(book.pop(block_hash, None) is not None for block_hash in block_hashes)

    def _live(self, worker_id: int) -> OrderedDict[int, float] | None:
        """The worker's book with expired entries dropped from its front."""
        book = self._expiry.get(worker_id)
        if not book:
            return book
        now = self._clock()
        while book:
            block_hash, expiry = next(iter(book.items()))
            if expiry > now:
                break
            del book[block_hash]
            self.expired += 1
        return book


@dataclass(frozen=True, slots=True)
class CachePrediction:
    """How the router predicts caches from its own decisions (frontend `--no-kv-events`,
    `--router-ttl`)."""

    kv_events: bool = True
    """False: approximate mode. No event subscription; what the router sent a worker is
    assumed cached there for the TTL."""
    ttl_s: float | None = None
    """How long routed blocks count without an event; None: 10 s with events, 120 s
    without."""

    def __post_init__(self) -> None:
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError("the router TTL must be positive")

    @property
    def resolved_ttl_s(self) -> float:
        if self.ttl_s is not None:
            return self.ttl_s
        return DEFAULT_ANTICIPATION_TTL_S if self.kv_events else DEFAULT_APPROXIMATE_TTL_S
