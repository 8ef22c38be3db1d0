"""The simulated engine's second KV tier: host memory that keeps what the device evicts.

vLLM's offloading connectors (and NVIDIA Dynamo's KVBM) copy a cached block out of the
device pool before its slot is reused, and load it back when a later prompt needs it,
which costs a copy instead of a prefill. None of those connectors start on the CPU
engine this repository runs (docs/kv_router.md, "KV cache tiers"), so the mocker models
the tier instead, for the router and the benchmarks:

* a block evicted from the device pool (`kv_cache.KvBlockPool`) is stored here, least
  recently used last; a block already here is only refreshed;
* the tier holds `capacity` blocks: storing one more drops the least recently used one,
  which is then gone from the worker;
* a prompt whose prefix runs on into blocks held here has them loaded back ("onboarded")
  into new device blocks at admission; the copy here stays (it is a copy, as in vLLM's
  CPU offloading), refreshed as just used.

Only bookkeeping lives here: the pool decides when blocks move and announces each move
as a KV event of the right `medium`, so the device pool's event order stays one list.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class HostTierStats:
    """What the tier did since start (for tests and the benchmark)."""

    stored: int = 0  # blocks copied in from the device pool
    dropped: int = 0  # blocks dropped to make room (least recently used)
    onboarded: int = 0  # blocks loaded back into the device pool


class HostTier:
    """An LRU set of content hashes, with each block's parent for its KV events."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"host tier capacity must be positive, got {capacity}")
        self.capacity = capacity
        # content hash -> parent content hash, least recently used first
        self._blocks: OrderedDict[int, int | None] = OrderedDict()
        self.stats = HostTierStats()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def store(self, block_hash: int, parent: int | None) -> tuple[bool, list[int]]:
        """Keep a block the device pool evicts: (whether it is new here, the blocks
        dropped to make room for it, least recently used first)."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return False, []
        dropped: list[int] = []
        while len(self._blocks) >= self.capacity:
            old, _ = self._blocks.popitem(last=False)
            dropped.append(old)
        self._blocks[block_hash] = parent
        self.stats.stored += 1
        self.stats.dropped += len(dropped)
        return True, dropped

    def onboard(self, block_hash: int) -> int | None:
        """A prompt loads the block back to the device: refresh it, return its parent."""
        self._blocks.move_to_end(block_hash)  # KeyError: not here, a caller bug
        self.stats.onboarded += 1
        return self._blocks[block_hash]

    def clear(self) -> None:
        self._blocks.clear()
