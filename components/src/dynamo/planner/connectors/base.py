"""`Connector`: the planner's one seam to whatever runs the workers."""

from __future__ import annotations

from typing import Protocol

from dynamo.planner.pools import PoolRole


class ConnectorError(Exception):
    """The connector could not read or set replicas. `transient`: a later try may work (a
    server not reached, a 5xx), so the planner skips the interval; otherwise (a missing
    Deployment, missing RBAC) it stops with the message, which says what to fix."""

    @property
    def transient(self) -> bool:
        return False


class Connector(Protocol):
    """Sets and reads the replicas of each pool.

    `scale` asks for a count and returns once the request is made (a started process, an
    accepted PATCH), not once the workers serve; `replicas` is what runs now (processes
    alive; the Deployment's `status.replicas`). Scaling down must lose nothing: a worker
    told to stop drains (SIGTERM, `--drain-timeout`), and what it still holds at the
    deadline migrates to another worker (the frontend's `--migration-limit`)."""

    async def start(self) -> None:
        """Connect (`kubernetes`) or prepare (`local`: its log directory); the planner then
        scales each pool to its minimum."""

    async def replicas(self, role: PoolRole) -> int: ...

    async def scale(self, role: PoolRole, replicas: int) -> None: ...

    async def close(self) -> None:
        """Stop acting; `local` also stops (drains) every worker it started."""
