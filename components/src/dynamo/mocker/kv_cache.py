"""The simulated engine's KV-cache block pool, with prefix caching and LRU eviction.

A pool of `num_blocks` physical blocks, each in one of three states:

* **private**: mutable, owned by one running request (blocks being prefilled, the partial
  tail, speculative slots). Only counted: their content has no name yet.
* **cached, referenced**: immutable, named by its content hash
  (`dynamo.llm.kv_router.hashing`), in use by one or more running requests;
* **cached, evictable**: immutable and reusable by a later request with the same prefix,
  but used by none; evicted least-recently-released first when space is needed.

Only blocks completely filled by accepted tokens ever become cached (the caller decides
which, through `ActiveSequences`), so a `KvBlockStored` event can never name a block that
held rejected speculative tokens. The pool records the router-visible consequences as
wire event payloads (`KvBlockStored` on first caching, `KvBlockRemoved` on eviction,
`KvAllCleared` on `clear`), merged where consecutive, for the engine to hand out per step.

Two identical blocks computed concurrently by two requests collapse into one cached block
(the second request's private block is freed and it references the cached one), exactly
one `KvBlockStored` is announced for it.

With a second tier (`host_tier.HostTier`, `--kv-host-blocks`) an evicted block moves there
(a `KvBlockRemoved` of the device tier, then a `KvBlockStored` of medium CPU), a block the
tier drops is announced removed from it, and a prefix hit found there is loaded back into
device blocks when a request references it (`acquire`; a `KvBlockStored` on the device).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from dynamo.llm.protocols import (
    KvAllCleared,
    KvBlockRemoved,
    KvBlockStored,
    KvEventData,
    KvMedium,
)
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.host_tier import HostTier


class KvBlockPool:
    """Block accounting of one simulated engine (no token contents are stored)."""

    def __init__(
        self, num_blocks: int, *, enable_prefix_caching: bool = True, host_blocks: int = 0
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # The second tier: none without prefix caching (nothing is ever named to keep).
        self.host = HostTier(host_blocks) if host_blocks and enable_prefix_caching else None
        self._refs: dict[int, int] = {}  # content hash -> running requests using it
        self._parents: dict[int, int | None] = {}  # cached block -> its parent (for events)
        # Cached blocks with no reference, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._private = 0
        self._events: list[KvEventData] = []
        self.evictions = 0

    @classmethod
    def for_engine(cls, config: MockEngineConfig) -> KvBlockPool:
        """The pool of an engine of `config` (device blocks, prefix caching, host tier)."""
        return cls(
            config.num_gpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            host_blocks=config.kv_host_blocks,
        )

    # ------------------------------------------------------------------ views

    @property
    def used_blocks(self) -> int:
        """Blocks holding anything: private, referenced or evictable."""
        return len(self._refs) + self._private

    @property
    def free_blocks(self) -> int:
        """Blocks never used or already evicted."""
        return self.num_blocks - self.used_blocks

    @property
    def active_blocks(self) -> int:
        """Blocks running requests hold (what a router should count as load)."""
        return self.used_blocks - len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Blocks named by a content hash (referenced or evictable)."""
        return len(self._refs)

    @property
    def evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def private_blocks(self) -> int:
        return self._private

    @property
    def usage(self) -> float:
        """Fraction of the pool running requests hold (vLLM's ``kv_cache_usage``)."""
        return self.active_blocks / self.num_blocks

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._refs

    def refcount(self, block_hash: int) -> int:
        return self._refs.get(block_hash, 0)

    def match_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading `block_hashes` are cached (a prefix-cache hit), in the device
        pool or, when there is one, the host tier."""
        if not self.enable_prefix_caching:
            return 0
        host = self.host if self.host is not None else ()
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._refs and block_hash not in host:
                break
            hits += 1
        return hits

    def can_allocate(self, num_blocks: int, reusing: Iterable[int] = ()) -> bool:
        """Whether `num_blocks` private blocks fit after referencing `reusing` (cached
        blocks that then stop being evictable, or host-tier blocks that need a device
        block each to be loaded back into)."""
        pinned = onboard = 0
        for block_hash in reusing:
            pinned += block_hash in self._evictable
            onboard += block_hash not in self._refs
        return num_blocks + onboard <= self.free_blocks + len(self._evictable) - pinned

    # ------------------------------------------------------------------ changes

    def acquire(self, block_hashes: Iterable[int]) -> int:
        """Reference cached blocks (a request reuses them); they stop being evictable.
        Those found in the host tier instead are loaded back into new device blocks (which
        `can_allocate` must have counted) and announced stored on the device. Returns how
        many were loaded back."""
        hashes = list(block_hashes)
        onboard = [h for h in hashes if h not in self._refs]
        for block_hash in hashes:
            if block_hash in self._refs:
                self._refs[block_hash] += 1
                self._evictable.pop(block_hash, None)
        if not onboard:
            return 0
        if self.host is None:
            raise KeyError(f"block {onboard[0]:x} is not cached")  # a caller bug
        # Read (and refresh) the copies before making room: room is made by evicting to
        # the host tier, which must not drop what is being loaded from it.
        parents = [self.host.onboard(h) for h in onboard]
        if not self.allocate(len(onboard)):
            raise RuntimeError("no room to load host-tier blocks back (can_allocate?)")
        self._private -= len(onboard)
        for block_hash, parent in zip(onboard, parents, strict=True):
            self._refs[block_hash] = 1
            self._parents[block_hash] = parent
            self._emit_stored(block_hash, parent, KvMedium.GPU)
        return len(onboard)

    def release(self, block_hashes: Sequence[int]) -> None:
        """Drop one reference per block. Unreferenced blocks become evictable, the last
        block of the sequence first: it is the least likely to be shared, so it should
        go before its parents (vLLM frees in the same order)."""
        for block_hash in reversed(block_hashes):
            left = self._refs[block_hash] - 1
            self._refs[block_hash] = left
            if left == 0:
                self._evictable[block_hash] = None

    def allocate(self, num_blocks: int) -> bool:
        """Take `num_blocks` private blocks, evicting cached ones if needed. False (and no
        change) when they do not fit."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.free_blocks + len(self._evictable):
            return False
        shortfall = num_blocks - self.free_blocks
        evicted = [self._evictable.popitem(last=False)[0] for _ in range(max(shortfall, 0))]
        for block_hash in evicted:
            del self._refs[block_hash]
            self.evictions += 1
            self._emit_removed(block_hash, KvMedium.GPU)
        for block_hash in evicted:  # after the removals: one event for them all
            self._spill(block_hash, self._parents.pop(block_hash, None))
        self._private += num_blocks
        return True

    def _spill(self, block_hash: int, parent: int | None) -> None:
        """Keep an evicted block in the host tier, if there is one, and announce it there
        (and the blocks the tier drops for it)."""
        if self.host is None:
            return
        added, dropped = self.host.store(block_hash, parent)
        for gone in dropped:
            self._emit_removed(gone, KvMedium.CPU)
        if added:
            self._emit_stored(block_hash, parent, KvMedium.CPU)

    def free(self, num_blocks: int) -> None:
        """Give private blocks back (a request finished or was preempted)."""
        if not 0 <= num_blocks <= self._private:
            raise ValueError(f"cannot free {num_blocks} of {self._private} private blocks")
        self._private -= num_blocks

    def commit(self, block_hashes: Sequence[int], parent_hash: int | None) -> None:
        """Turn private blocks, now completely filled with accepted tokens, into cached
        blocks named by `block_hashes` (chained from `parent_hash`) referenced by the
        caller. A block already cached under the same hash is reused and the private
        copy freed; only blocks cached for the first time are announced."""
        if len(block_hashes) > self._private:
            raise ValueError(f"cannot commit {len(block_hashes)} of {self._private} private blocks")
        if not self.enable_prefix_caching:
            raise RuntimeError("commit with prefix caching disabled")
        parent = parent_hash
        for block_hash in block_hashes:
            self._private -= 1
            refs = self._refs.get(block_hash)
            if refs is None:
                self._refs[block_hash] = 1
                self._parents[block_hash] = parent
                self._emit_stored(block_hash, parent, KvMedium.GPU)
            else:
                self._refs[block_hash] = refs + 1
                self._evictable.pop(block_hash, None)
            parent = block_hash

    def clear(self) -> bool:
        """Drop every cached block, host tier included (vLLM's ``reset_prefix_cache``).
        Refused (False) while a running request references one."""
        if len(self._evictable) != len(self._refs):
            return False
        self._refs.clear()
        self._parents.clear()
        self._evictable.clear()
        if self.host is not None:
            self.host.clear()
        self._events = [KvAllCleared()]  # earlier events no longer matter to anyone
        return True

    def take_events(self) -> list[KvEventData]:
        """The cache events since the last call, in order."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ events

    def _emit_stored(self, block_hash: int, parent: int | None, medium: KvMedium) -> None:
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, KvBlockStored)
            and last.medium is medium
            and last.block_hashes[-1] == parent
        ):
            last.block_hashes.append(block_hash)
        else:
            stored = KvBlockStored(block_hashes=[block_hash], parent_hash=parent, medium=medium)
            self._events.append(stored)

    def _emit_removed(self, block_hash: int, medium: KvMedium) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, KvBlockRemoved) and last.medium is medium:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(KvBlockRemoved(block_hashes=[block_hash], medium=medium))
