"""Which worker holds which cached prefix: the KV indexer.

A content hash (`hashing`) identifies a block *and its whole prefix*, so the radix tree
over hash chains collapses into a flat map ``content hash -> bitmask of workers``: walking
a request's hash list through that map is walking the tree from the root. Each worker gets
a bit (indices are reused after a worker leaves); Python ints make the mask unbounded, and
with up to 64 workers it stays a machine-word-sized int, so intersecting "who still
matches" is a single ``&``. A per-worker map of hashes makes ``remove_worker`` and
``KvAllCleared`` proportional to that worker's blocks only.

Tiers (`tiers`): events name the tier (`KvMedium`) a block entered or left, and a worker
may hold a block in several (an offloaded copy outlives the device one, and comes back).
The per-worker map keeps each block's set of tiers, a removal clears one tier only, and the
worker mask of a block means "holds it in some tier", so a matched prefix runs through
blocks of any tier. A second mask map marks the workers holding a block *only* outside the
device tier; `find_matches` reads it on the same walk and reports, for just the workers
whose match reaches such a block, each matched block's best tier (`TierMatch`). With no
offloaded block anywhere that map is empty and the walk costs what it did before tiers.

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
from dynamo.llm.kv_router.tiers import TIER_BITS, TIER_ORDER, TierMatch, best_tier
from dynamo.llm.protocols import (
    KvAllCleared,
    KvBlockRemoved,
    KvBlockStored,
    KvMedium,
    RouterEvent,
)

_DEVICE_BIT = TIER_BITS[KvMedium.GPU]


@dataclass(slots=True)
class OverlapScores:
    """Per worker, how many leading blocks of a request it already caches (in any tier).

    Workers with no matching first block are absent; `get` returns 0 for them. `tiers`
    holds the workers whose matched prefix includes a block held only outside the device
    tier; every block of the others' matches is on the device.
    """

    scores: dict[int, int] = field(default_factory=dict)
    tiers: dict[int, TierMatch] = field(default_factory=dict)

    def get(self, worker_id: int) -> int:
        return self.scores.get(worker_id, 0)

    def tier_match(self, worker_id: int) -> TierMatch | None:
        """Each matched block's best tier; None when all are on the device."""
        return self.tiers.get(worker_id)

    def device_blocks(self, worker_id: int) -> int:
        """Leading blocks of the request the worker holds in its device tier."""
        match = self.tiers.get(worker_id)
        return match.device_prefix if match is not None else self.get(worker_id)

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
        # content hash -> bitmask of workers holding it in offload tiers only
        self._offloaded: dict[int, int] = {}
        self._blocks_of: dict[int, dict[int, int]] = {}  # worker -> content hash -> TIER_BITS
        self._tier_blocks: dict[int, list[int]] = {}  # worker -> blocks per TIER_ORDER tier
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
            self.store(worker_id, data.block_hashes, data.medium)
        elif isinstance(data, KvBlockRemoved):
            self.remove(worker_id, data.block_hashes, data.medium)
        elif isinstance(data, KvAllCleared):
            self.clear_worker(worker_id)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"unknown KV event data {type(data).__name__}")

    def store(
        self, worker_id: int, block_hashes: Iterable[int], medium: KvMedium = KvMedium.GPU
    ) -> None:
        """Mark `block_hashes` as cached on `worker_id` in tier `medium` (idempotent)."""
        bit = 1 << self._bit_for(worker_id)
        tier = TIER_BITS[medium]
        offload = medium is not KvMedium.GPU
        nodes, offloaded = self._nodes, self._offloaded
        get = nodes.get
        owned = self._blocks_of[worker_id]
        added = 0
        for block_hash in block_hashes:
            held = owned.get(block_hash, 0)
            if held & tier:
                continue
            added += 1
            owned[block_hash] = held | tier
            if not held:
                nodes[block_hash] = get(block_hash, 0) | bit
                if offload:
                    offloaded[block_hash] = offloaded.get(block_hash, 0) | bit
            elif not offload and not held & _DEVICE_BIT:  # back on the device
                self._unset(offloaded, block_hash, ~bit)
        self._tier_blocks[worker_id][TIER_ORDER.index(medium)] += added
        self.stats.blocks_stored += added

    def remove(
        self, worker_id: int, block_hashes: Iterable[int], medium: KvMedium = KvMedium.GPU
    ) -> None:
        """Forget `block_hashes` in tier `medium` of `worker_id` (its copies in other tiers
        stay); blocks it does not hold there are ignored."""
        owned = self._blocks_of.get(worker_id)
        if owned is None:
            return
        bit = 1 << self._bit_of[worker_id]
        keep = ~bit
        tier = TIER_BITS[medium]
        offload = medium is not KvMedium.GPU
        nodes, offloaded = self._nodes, self._offloaded
        removed = 0
        for block_hash in block_hashes:
            held = owned.get(block_hash, 0)
            if not held & tier:
                self.stats.removals_ignored += 1
                continue
            removed += 1
            left = held & ~tier
            if left:
                owned[block_hash] = left
                if not offload:  # only offloaded copies are left
                    offloaded[block_hash] = offloaded.get(block_hash, 0) | bit
                continue
            del owned[block_hash]
            self._unset(nodes, block_hash, keep)
            if offload:
                self._unset(offloaded, block_hash, keep)
        self._tier_blocks[worker_id][TIER_ORDER.index(medium)] -= removed
        self.stats.blocks_removed += removed

    def clear_worker(self, worker_id: int) -> None:
        """Forget every block of `worker_id` in every tier but keep it known (its cache
        was reset)."""
        owned = self._blocks_of.get(worker_id)
        if not owned:
            return
        keep = ~(1 << self._bit_of[worker_id])
        nodes, offloaded = self._nodes, self._offloaded
        for block_hash, held in owned.items():
            self._unset(nodes, block_hash, keep)
            if not held & _DEVICE_BIT:
                self._unset(offloaded, block_hash, keep)
        counts = self._tier_blocks[worker_id]
        self.stats.blocks_removed += sum(counts)
        counts[:] = [0] * len(counts)
        owned.clear()

    def remove_worker(self, worker_id: int) -> None:
        """Drop a worker entirely (its lease is gone); its bit becomes reusable."""
        if worker_id not in self._bit_of:
            return
        self.clear_worker(worker_id)
        bit = self._bit_of.pop(worker_id)
        del self._worker_at[bit]
        del self._blocks_of[worker_id]
        del self._tier_blocks[worker_id]
        self._last_event_id.pop(worker_id, None)
        self._free_bits.append(bit)
        self._free_bits.sort(reverse=True)

    # ------------------------------------------------------------------ queries

    def find_matches(self, block_hashes: Sequence[int]) -> OverlapScores:
        """Per worker, the number of leading `block_hashes` it holds in any tier, and the
        tiers of the matched blocks of the workers whose match is not all on the device.

        Walks the request's chain once, intersecting the worker masks, and stops as soon
        as no worker is left, so the cost is bounded by the deepest match (plus one).
        """
        scores: dict[int, int] = {}
        if not block_hashes:
            return OverlapScores(scores)
        nodes = self._nodes
        offloaded = self._offloaded  # empty unless some worker offloads: then skipped
        live = nodes.get(block_hashes[0], 0)
        mixed = live & offloaded.get(block_hashes[0], 0) if offloaded else 0
        depth = 1
        if live:
            for depth in range(1, len(block_hashes)):
                still = live & nodes.get(block_hashes[depth], 0)
                if offloaded:
                    mixed |= still & offloaded.get(block_hashes[depth], 0)
                if still != live:
                    self._credit(live & ~still, depth, scores)
                    live = still
                    if not live:
                        break
            else:
                depth = len(block_hashes)
            if live:
                self._credit(live, depth, scores)
        return OverlapScores(scores, self._tier_matches(mixed, block_hashes, scores))

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
        """Workers holding `block_hash` in any tier (for tests and debugging)."""
        mask = self._nodes.get(block_hash, 0)
        return {w for bit, w in self._worker_at.items() if mask >> bit & 1}

    def tiers_of(self, worker_id: int, block_hash: int) -> set[KvMedium]:
        """The tiers in which `worker_id` holds `block_hash` (for tests and debugging)."""
        held = self._blocks_of.get(worker_id, {}).get(block_hash, 0)
        return {medium for medium, bit in TIER_BITS.items() if held & bit}

    def tier_counts(self, worker_id: int) -> dict[str, int]:
        """Blocks per tier on `worker_id` (a block held in two tiers counts in both)."""
        counts = self._tier_blocks.get(worker_id, [0] * len(TIER_ORDER))
        return {medium.value: count for medium, count in zip(TIER_ORDER, counts, strict=True)}

    # ------------------------------------------------------------------ internals

    def _bit_for(self, worker_id: int) -> int:
        bit = self._bit_of.get(worker_id)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._bit_of)
            self._bit_of[worker_id] = bit
            self._worker_at[bit] = worker_id
            self._blocks_of[worker_id] = {}
            self._tier_blocks[worker_id] = [0] * len(TIER_ORDER)
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

    def _tier_matches(
        self, mixed: int, block_hashes: Sequence[int], scores: dict[int, int]
    ) -> dict[int, TierMatch]:
        """The best tier of each matched block, for the workers of `mixed` (those whose
        match reaches a block they hold only outside the device tier)."""
        matches: dict[int, TierMatch] = {}
        worker_at = self._worker_at
        while mixed:
            low = mixed & -mixed
            mixed ^= low
            worker_id = worker_at[low.bit_length() - 1]
            owned = self._blocks_of[worker_id]
            matched = block_hashes[: scores[worker_id]]
            matches[worker_id] = TierMatch(tuple(best_tier(owned[h]) for h in matched))
        return matches
