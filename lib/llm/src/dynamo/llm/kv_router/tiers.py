"""How much a cached block is worth to the router, by the tier that holds it.

A block in the engine's device pool is used as is; one in an offload tier (host memory,
disk) must be copied back first, which costs far less than computing it again but is not
free, and the slower the tier the less it saves. So a matched prompt block counts in the
router's cost with the weight of the best tier holding it (`TierWeights`): the device
tier 1, host memory `host` (0.75 by default) and disk `disk` (0.25), NVIDIA Dynamo's
defaults. ``blocks_to_prefill = request_blocks - weighted_overlap`` then makes a worker
with a prefix in host memory cheaper than one without it and dearer than one holding it
on the device.

`TierMatch` is what the indexer reports for one worker whose matched prefix reaches
outside the device tier: each matched block's best tier, from which the scheduler takes
the weighted overlap past whatever it already counts as device-resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dynamo.llm.protocols import KvMedium

DEFAULT_HOST_TIER_WEIGHT = 0.75
"""A prefix hit in host memory: a PCIe copy instead of a prefill (Dynamo's default)."""
DEFAULT_DISK_TIER_WEIGHT = 0.25
"""A prefix hit on disk: slower to load back, saves less (Dynamo's default)."""

TIER_ORDER: tuple[KvMedium, ...] = (KvMedium.GPU, KvMedium.CPU, KvMedium.STORAGE)
"""Tiers from the fastest: a block held in several counts as in the first of them."""


@dataclass(frozen=True, slots=True)
class TierWeights:
    """Weight of a matched block per tier (device 1; offload tiers in [0, 1])."""

    host: float = DEFAULT_HOST_TIER_WEIGHT
    disk: float = DEFAULT_DISK_TIER_WEIGHT

    def __post_init__(self) -> None:
        for name in ("host", "disk"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} tier weight must be in [0, 1], got {value}")

    def of(self, medium: KvMedium) -> float:
        if medium is KvMedium.GPU:
            return 1.0
        return self.host if medium is KvMedium.CPU else self.disk

    def as_dict(self) -> dict[str, float]:
        return {medium.value: self.of(medium) for medium in TIER_ORDER}

    def value(self, match: TierMatch | None, device: int, matched: int) -> PrefixValue:
        """What a prefix of `matched` blocks is worth whose first `device` blocks are (or
        will be) on the device: those count 1, the rest at their tier's weight (`match`;
        with None, every matched block is on the device)."""
        if match is None or matched <= device:
            return PrefixValue(float(matched), 0, 0)
        counts = match.counts(device, matched)
        return PrefixValue(
            device + match.weighted(self, device, matched),
            counts[KvMedium.CPU],
            counts[KvMedium.STORAGE],
        )


class PrefixValue(NamedTuple):
    """A matched prefix as the cost counts it: its blocks at their tiers' weights, and
    how many of them must be loaded back from host memory or disk."""

    weighted: float
    host_blocks: int
    disk_blocks: int


@dataclass(frozen=True, slots=True)
class TierMatch:
    """The best tier of each block of one worker's matched prefix, in prompt order."""

    tiers: tuple[KvMedium, ...]

    @property
    def device_prefix(self) -> int:
        """Leading matched blocks held in the device tier."""
        for index, medium in enumerate(self.tiers):
            if medium is not KvMedium.GPU:
                return index
        return len(self.tiers)

    def counts(self, start: int = 0, end: int | None = None) -> dict[KvMedium, int]:
        """Blocks per tier among the matched blocks ``[start, end)``."""
        counts = dict.fromkeys(TIER_ORDER, 0)
        for medium in self.tiers[start:end]:
            counts[medium] += 1
        return counts

    def weighted(self, weights: TierWeights, start: int = 0, end: int | None = None) -> float:
        """The matched blocks ``[start, end)``, each counted with its tier's weight."""
        return sum(weights.of(medium) for medium in self.tiers[start:end])


TIER_BITS: dict[KvMedium, int] = {medium: 1 << i for i, medium in enumerate(TIER_ORDER)}
"""One bit per tier, the fastest lowest: a block's tiers on one worker fit one small int."""


def best_tier(bits: int) -> KvMedium:
    """The fastest tier among the set `bits` (`TIER_BITS`) of a held block."""
    return TIER_ORDER[(bits & -bits).bit_length() - 1]
