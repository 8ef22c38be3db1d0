"""A local JetStream cluster of `nats-server` processes (`--cluster-size`), for development
and tests of what a cluster changes (leader elections, a node lost)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from dynamo.nats_server.security import ServerSecurity
from dynamo.nats_server.server import (
    ClusterMembership,
    NatsServer,
    NatsServerError,
)
from dynamo.runtime.ports import free_port

log = logging.getLogger(__name__)


class NatsCluster:
    """A JetStream cluster of `size` `nats-server` processes on one host, for development
    and tests: node i listens for clients on `ports[i]` and for routes on a port of its
    own, each with its own store, all in one cluster named `name`.

    `url` lists every node (comma-separated), which is what clients are given: they connect
    to one and move to another when it goes. `start()` returns once every node accepts
    clients and the cluster has elected a JetStream metadata leader, so streams and
    buckets with replicas can be created at once.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        name: str = "dynamo",
        store_root: Path | None = None,
        security: ServerSecurity | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        if ports is not None and len(ports) != size:
            raise ValueError(f"{size} nodes need {size} client ports, got {len(ports)}")
        self.name = name
        self._own_root = store_root is None
        self.store_root = (
            Path(store_root) if store_root else Path(tempfile.mkdtemp(prefix="dyn-nats-cluster-"))
        )
        client_ports = list(ports) if ports else [free_port(host) for _ in range(size)]
        route_ports = [free_port(host) for _ in range(size)]
        monitor_ports = [free_port(host) for _ in range(size)]
        self.nodes = [
            NatsServer(
                client_ports[i],
                host=host,
                store_dir=self.store_root / f"n{i + 1}",
                security=security,
                monitor_port=monitor_ports[i],
                cluster=ClusterMembership(
                    cluster_name=name,
                    server_name=f"n{i + 1}",
                    route_host=host,
                    route_port=route_ports[i],
                    routes=tuple(
                        f"nats-route://{host}:{port}"
                        for j, port in enumerate(route_ports)
                        if j != i
                    ),
                ),
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated."""
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every node (together: JetStream needs a quorum to elect its leader) and
        wait until the cluster can create replicated streams; NatsServerError otherwise."""
        for node in self.nodes:
            node.spawn()
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                node.wait_ready(max(0.1, deadline - time.monotonic()))
            self.wait_for_leader(max(0.1, deadline - time.monotonic()))
        except NatsServerError:
            self.stop()
            raise
        return self

    def wait_for_leader(self, timeout: float = 30.0) -> None:
        """Wait until the running nodes agree on a JetStream metadata leader, each reports
        itself healthy, and the leader counts every other running node as a current peer:
        before that, creating a replicated stream fails with "no suitable peers for
        placement" (the leader still holds a peer offline)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.metadata_leader()
            if (
                leader is not None
                and all(
                    node.monitor("/healthz") == {"status": "ok"}
                    for node in self.nodes
                    if node.running
                )
                and self._peers_current(leader)
            ):
                return
            time.sleep(0.05)
        raise NatsServerError(f"no JetStream metadata leader in cluster {self.name!r}")

    def _peers_current(self, leader: NatsServer) -> bool:
        """Whether `leader`'s metadata group lists every other running node as current
        and online."""
        meta = (leader.monitor("/jsz") or {}).get("meta_cluster")
        peers = meta.get("replicas") if isinstance(meta, dict) else None
        if not isinstance(peers, list):
            return False
        current = {
            peer.get("name")
            for peer in peers
            if isinstance(peer, dict) and peer.get("current") and not peer.get("offline")
        }
        others = {
            node.cluster.server_name
            for node in self.nodes
            if node.running and node.cluster is not None and node is not leader
        }
        return others <= current

    def metadata_leader(self) -> NatsServer | None:
        """The node that leads the JetStream metadata group, when the running nodes agree
        on one (tests stop it to exercise a leader election)."""
        names = set()
        for node in self.nodes:
            if node.running:
                jsz = node.monitor("/jsz") or {}
                meta = jsz.get("meta_cluster")
                names.add(meta.get("leader") if isinstance(meta, dict) else None)
        if len(names) != 1:
            return None
        leader = names.pop()
        return next(
            (node for node in self.nodes if node.cluster and node.cluster.server_name == leader),
            None,
        )

    def stop(self) -> None:
        """Stop every node (their stores stay until `close()`)."""
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Stop every node and remove a temporary store root."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.store_root, ignore_errors=True)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
