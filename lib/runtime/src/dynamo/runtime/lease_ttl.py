"""How long a leased key outlives its process: the default lease TTL, on one server and
on a cluster, and the warning when a chosen TTL is too short for a cluster.

Separate from `runtime.py`, which applies the TTL, because command lines need it before
any runtime exists (the workers' `--lease-ttl` help shows the defaults, the vLLM worker's
config resolves the TTL): they need the policy, not the NATS connection.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 5.0
CLUSTER_LEASE_TTL_S = 18.0
"""The default lease on a NATS cluster. A replicated stream whose leader's node is lost
takes nats-server 4 to 9 s (its Raft election timeout, not configurable) to elect
another; no key can be re-put meanwhile, and a key whose last put is older than its TTL
when the new leader takes over expires. The last heartbeat is at most TTL/3 old at the
loss and a failed heartbeat is retried every 0.5 s, so 2/3 of the TTL must exceed the
9 s election plus a retry and a put: 18 s leaves 12 s."""
ENV_LEASE_TTL = "DYN_LEASE_TTL"


def default_lease_ttl(replicas: int = 1) -> float:
    """`$DYN_LEASE_TTL` seconds, else 5 on a single server and 18 when buckets are
    replicated over a cluster (`replicas` > 1): see `CLUSTER_LEASE_TTL_S`."""
    value = os.environ.get(ENV_LEASE_TTL, "").strip()
    if value:
        return float(value)
    return DEFAULT_LEASE_TTL_S if replicas <= 1 else CLUSTER_LEASE_TTL_S


def warn_short_cluster_lease(lease_ttl: float, replicas: int) -> None:
    """Say so when a lease could expire during a JetStream failover (see
    `CLUSTER_LEASE_TTL_S`)."""
    if replicas > 1 and lease_ttl < CLUSTER_LEASE_TTL_S:
        log.warning(
            "lease TTL %.1fs with replicated buckets: losing the NATS node that leads the "
            "registry stops its writes for the 4-9 s JetStream takes to elect another, "
            "and a lease shorter than %.0fs may expire meanwhile (the worker briefly "
            "leaves routing); raise --lease-ttl / $DYN_LEASE_TTL",
            lease_ttl,
            CLUSTER_LEASE_TTL_S,
        )
