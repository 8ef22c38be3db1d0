"""The worker pools a planner sizes: one aggregated pool, or a prefill and a decode pool."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PoolRole(enum.StrEnum):
    """What the workers of a pool do; also the pool's name in flags, metrics and logs."""

    AGGREGATED = "aggregated"  # prefill and decode on the same worker
    PREFILL = "prefill"  # disaggregated: prompts only, KV handed to a decode worker
    DECODE = "decode"  # disaggregated: generation from a handed-over (or local) prefill


class Topology(enum.StrEnum):
    AGGREGATED = "aggregated"
    DISAGGREGATED = "disaggregated"

    @property
    def roles(self) -> tuple[PoolRole, ...]:
        if self is Topology.AGGREGATED:
            return (PoolRole.AGGREGATED,)
        return (PoolRole.PREFILL, PoolRole.DECODE)


@dataclass(frozen=True)
class PoolSpec:
    """One pool: its role, the NATS component its workers register under (where their load
    reports are published) and the bounds on its replicas."""

    role: PoolRole
    component: str
    min_workers: int
    max_workers: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"{self.role} pool: need 0 <= min ({self.min_workers}) <= max ({self.max_workers})"
            )

    def clamp(self, replicas: int) -> int:
        return max(self.min_workers, min(self.max_workers, replicas))
