"""Which worker holds which cached prefix: the KV indexer.

A content hash (`hashing`) identifies a block *and its whole prefix*, so the radix tree
over hash chains collapses into a flat map ``content hash -> bitmask of workers``: walking
a request's hash list through that map is walking the tree from the root. Each worker gets
a bit (indices are reused after a worker leaves); Python ints make the mask unbounded, and
with up to 64 workers it stays a machine-word-sized int, so intersecting "who still
matches" is a single ``&``. A per-worker set of hashes makes ``remove_worker`` and
``KvAllCleared`` proportional to that worker's blocks only.

Robustness rules (events arrive over a replayable stream and may repeat):

* stored twice -> idempotent; removed for a block the worker does not hold -> ignored;
* a stored block whose parent is unknown is indexed anyway: its hash already encodes the
  whole prefix, and `find_matches` only counts *leading* matches, so an orphan can never
  produce a false hit; it starts counting as soon as its ancestors arrive;
* per worker, an event whose ``event_id`` is not greater than the last applied one is a
  duplicate from a replay and is dropped, except ``KvAllCleared``, which always applies
  and restarts the sequence (a restarted relay counts from zero again).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.protocols import KvAllCleared, KvBlockRemoved, KvBlockStored, RouterEvent


@dataclass(slots=True)
class OverlapScores:
    """Per worker, how many leading blocks of a request it already caches.

    Workers with no matching first block are absent; `get` returns 0 for them.
    """

    scores: dict[int, int] = field(default_factory=dict)

    def get(self, worker_id: int) -> int:
        return self.scores.get(worker_id, 0)

    def best(self) -> int:
        """The deepest match over all workers (0 when nobody matches)."""
        return max(self.scores.values(), default=0)


@dataclass(slots=True)
class IndexerStats:
    """Counters for the debug view: what was applied and what was dropped as stale."""

    events_applied: int = 0
    events_stale: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    removals_ignored: int = 0


class KvIndexer:
    """Content-hash index of the blocks each worker has cached."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._nodes: dict[int, int] = {}  # content hash -> bitmask of workers holding it
        self._blocks_of: dict[int, set[int]] = {}  # worker id -> content hashes it holds
        self._bit_of: dict[int, int] = {}  # worker id -> bit index
        self._worker_at: dict[int, int] = {}  # bit index -> worker id
        self._free_bits: list[int] = []  # released bit indices, reused smallest first
        self._last_event_id: dict[int, int] = {}
        self.stats = IndexerStats()

    # ------------------------------------------------------------------ events

    def apply(self, event: RouterEvent) -> None:
        """Apply one worker's KV event (stored / removed / cleared)."""
        worker_id = event.worker_id
        data = event.data
        last = self._last_event_id.get(worker_id)
        if last is not None and event.event_id <= last and not isinstance(data, KvAllCleared):
            self.stats.events_stale += 1
            return
        self._last_event_id[worker_id] = event.event_id
        self.stats.events_applied += 1
        if isinstance(data, KvBlockStored):
            self.store(worker_id, data.block_hashes)
        elif isinstance(data, KvBlockRemoved):
            self.remove(worker_id, data.block_hashes)
        elif isinstance(data, KvAllCleared):
            self.clear_worker(worker_id)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"unknown KV event data {type(data).__name__}")

    def store(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Mark `block_hashes` as cached on `worker_id` (idempotent)."""
        bit = 1 << self._bit_for(worker_id)
        nodes = self._nodes
        get = nodes.get
        owned = self._blocks_of[worker_id]
        before = len(owned)
        for block_hash in block_hashes:
            nodes[block_hash] = get(block_hash, 0) | bit
            owned.add(block_hash)
        self.stats.blocks_stored += len(owned) - before

    def remove(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Forget `block_hashes` on `worker_id`; blocks it does not hold are ignored."""
        owned = self._blocks_of.get(worker_id)
        if owned is None:
            return
        keep = ~(1 << self._bit_of[worker_id])
        nodes = self._nodes
        for block_hash in block_hashes:
            if block_hash not in owned:
                self.stats.removals_ignored += 1
                continue
            owned.discard(block_hash)
            self._unset(nodes, block_hash, keep)
            self.stats.blocks_removed += 1

    def clear_worker(self, worker_id: int) -> None:
        """Forget every block of `worker_id` but keep it known (its cache was reset)."""
        owned = self._blocks_of.get(worker_id)
        if not owned:
            return
        keep = ~(1 << self._bit_of[worker_id])
        nodes = self._nodes
        for block_hash in owned:
            self._unset(nodes, block_hash, keep)
        self.stats.blocks_removed += len(owned)
        owned.clear()

    def remove_worker(self, worker_id: int) -> None:
        """Drop a worker entirely (its lease is gone); its bit becomes reusable."""
        if worker_id not in self._bit_of:
            return
        self.clear_worker(worker_id)
        bit = self._bit_of.pop(worker_id)
        del self._worker_at[bit]
        del self._blocks_of[worker_id]
        self._last_event_id.pop(worker_id, None)
        self._free_bits.append(bit)
        self._free_bits.sort(reverse=True)

    # ------------------------------------------------------------------ queries

    def find_matches(self, block_hashes: Sequence[int]) -> OverlapScores:
        """Per worker, the number of leading `block_hashes` it holds.

        Walks the request's chain once, intersecting the worker masks, and stops as soon
        as no worker is left, so the cost is bounded by the deepest match (plus one).
        """
        scores: dict[int, int] = {}
        if not block_hashes:
            return OverlapScores(scores)
        nodes = self._nodes
        live = nodes.get(block_hashes[0], 0)
        depth = 1
        if live:
            for depth in range(1, len(block_hashes)):
                still = live & nodes.get(block_hashes[depth], 0)
                if still != live:
                    self._credit(live & ~still, depth, scores)
                    live = still
                    if not live:
                        break
            else:
                depth = len(block_hashes)
            if live:
                self._credit(live, depth, scores)
        return OverlapScores(scores)

    def find_matches_for_tokens(self, token_ids: Sequence[int]) -> OverlapScores:
        """`find_matches` over the content hashes of the full blocks of `token_ids`."""
        return self.find_matches(compute_block_hashes(token_ids, self.block_size))

    # ------------------------------------------------------------------ views

    def workers(self) -> list[int]:
        return list(self._bit_of)

    def block_count(self, worker_id: int) -> int:
        blocks = self._blocks_of.get(worker_id)
        return len(blocks) if blocks is not None else 0

    def num_unique_blocks(self) -> int:
        """Distinct content hashes held by at least one worker."""
        return len(self._nodes)

    def holders(self, block_hash: int) -> set[int]:
        """Workers holding `block_hash` (for tests and debugging, not the hot path)."""
        mask = self._nodes.get(block_hash, 0)
        return {w for bit, w in self._worker_at.items() if mask >> bit & 1}

    # ------------------------------------------------------------------ internals

    def _bit_for(self, worker_id: int) -> int:
        bit = self._bit_of.get(worker_id)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._bit_of)
            self._bit_of[worker_id] = bit
            self._worker_at[bit] = worker_id
            self._blocks_of[worker_id] = set()
        return bit

    @staticmethod
    def _unset(nodes: dict[int, int], block_hash: int, keep: int) -> None:
        mask = nodes.get(block_hash, 0) & keep
        if mask:
            nodes[block_hash] = mask
        else:
            nodes.pop(block_hash, None)

    def _credit(self, mask: int, depth: int, scores: dict[int, int]) -> None:
        worker_at = self._worker_at
        while mask:
            low = mask & -mask
            scores[worker_at[low.bit_length() - 1]] = depth
            mask ^= low
