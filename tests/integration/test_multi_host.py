"""The system spread over six "hosts", and what losing a host's network does to it.

Every process runs in a network namespace of its own (`dynamo.testing.netns`): a three-node
NATS JetStream cluster on nats1..nats3, a kv-mode frontend on `frontend`, one mocker
worker on each of w1 and w2. The hosts reach each other only through a bridge in the root
namespace, which the test also uses to talk to the frontend and to the NATS nodes'
monitoring ports, so every connection crosses a link the test can pull. Every component
gets the three NATS URLs and `--nats-replicas 3`. Claims:

* a chat request to the frontend's address succeeds, and every component really is
  connected from its own host (NATS sees the hosts' addresses, not loopback);
* cutting the link of the NATS node the frontend is connected to keeps the system
  serving: every request sent while the node is unreachable, and after it is back,
  succeeds (the frontend notices the silent connection and moves to another node);
* cutting a worker's link removes it from routing within 2x its lease TTL (its lease
  heartbeats no longer arrive), requests then all go to the other worker, and the worker
  comes back once its link does.

Only the worker whose link is cut has a short lease (see `LEASE_TTL_S` for why the other
keeps the cluster default), and the frontend places a lost request again after
`FIRST_TOKEN_TIMEOUT_S`. docs/runtime.md, "Testing across hosts", has the measurements.

A cut link drops packets silently (no RST, no FIN): a pulled cable, which a process
crash (the subject of test_nats_cluster.py) is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from dynamo.llm.kv_router.subjects import KV_EVENTS_STREAM
from dynamo.nats_server import ClusterMembership, NatsServer
from dynamo.testing import netns
from dynamo.testing.command_lines import frontend_argv
from dynamo.testing.http import http_post_json, kv_router_views, routed_totals
from dynamo.testing.jetstream import node_holding, prefer_stream_leaders
from dynamo.testing.netns import HostNetwork
from dynamo.testing.processes import ManagedProcess, serving_pids, wait_serving, wait_while_alive
from dynamo.testing.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "multi-host-model"
NATS_HOSTS = ("nats1", "nats2", "nats3")
WORKER_HOSTS = ("w1", "w2")
HOSTS = (*NATS_HOSTS, "frontend", *WORKER_HOSTS)
NATS_PORT, ROUTE_PORT, MONITOR_PORT, HTTP_PORT = 4222, 6222, 8222, 8000
CUT_WORKER, STEADY_WORKER = WORKER_HOSTS
LEASE_TTL_S = 2.0
"""The lease (`--lease-ttl`) of `CUT_WORKER`, the worker whose link is cut: short, so
that it leaves routing in seconds. `STEADY_WORKER` and the frontend keep the cluster
default (18 s), which outlives a JetStream election: a NATS node that comes back after a
partition disrupts the cluster's Raft groups (it campaigned alone, and its higher term
makes every leader step down), and the seconds of those elections would expire a 2 s
lease. So the NATS cut may make `CUT_WORKER` leave routing for a while, never both
workers. (The frontend holds no lease of its own; its TTL is how long a key missing after
its reconnect may take to come back before it counts as gone.)"""
FIRST_TOKEN_TIMEOUT_S = 10.0
"""The frontend's `--first-token-timeout`: a request published just as the frontend
moves to another node can follow a route to the cut node that the cluster still
believes in and be lost; the request is placed again after this long instead of after
the default 300 s. It is longer than the 4-6 s a client takes to notice a silent
connection, so that noticing it (and placing the request again at once) comes first.
(The mocker's first token comes within milliseconds.)"""
SETTLED_FOR_S = 2.0
"""How long the cluster must look whole before the next phase starts: a node back from a
partition disrupts the Raft groups a moment after its routes return (see `LEASE_TTL_S`)."""
REJOIN_TIMEOUT_S = 30.0
"""How long both workers may take to be back in routing after the cut node returns."""
REQUESTS_PER_PHASE = 6
REQUEST_TIMEOUT_S = 30.0
STREAMS = ("KV_dyn_instances", "KV_dyn_models", KV_EVENTS_STREAM)
"""The registry, the model cards and the KV events: what a node loss must not stall."""


@dataclass
class Topology:
    net: HostNetwork
    nodes: dict[str, NatsServer]
    frontend: ManagedProcess
    workers: dict[str, ManagedProcess]
    namespace: str

    @property
    def nats_url(self) -> str:
        return ",".join(node.url for node in self.nodes.values())

    @property
    def base_url(self) -> str:
        return f"http://{self.net.address('frontend')}:{HTTP_PORT}"

    @property
    def endpoint_path(self) -> str:
        return f"{self.namespace}/backend/generate"

    def routers(self) -> list[dict]:
        """The KV router of each frontend process (one, or N with `--http-workers N`)."""
        return kv_router_views(self.base_url, MODEL, self.endpoint_path)

    def live_workers(self) -> list[str]:
        """Workers some frontend process still routes to."""
        return sorted({w for router in self.routers() for w in router["feed"]["live_workers"]})

    def routable_workers(self) -> list[str]:
        """Workers every frontend process routes to."""
        sets = [set(router["feed"]["live_workers"]) for router in self.routers()]
        return sorted(set.intersection(*sets))

    def routed(self) -> dict[str, int]:
        """Requests placed on each worker so far, by all frontend processes together."""
        return routed_totals(self.routers())

    def frontend_pids(self) -> list[int]:
        """The frontend processes holding NATS connections (N with `--http-workers N`)."""
        return serving_pids(self.frontend.pid)

    def processes(self) -> list[ManagedProcess]:
        return [self.frontend, *self.workers.values()]


def in_host(net: HostNetwork, host: str, argv: Sequence[str]) -> list[str]:
    """`argv` run inside `host`, through the parent-death wrapper: `ip netns exec` and
    the wrapper both exec, so the program keeps the pid `Popen` gave and gets SIGTERM
    when this test process dies, however it dies."""
    wrapper = [sys.executable, "-m", "dynamo.runtime.parent_death", "--parent-pid"]
    return [*net.launcher(host), *wrapper, str(os.getpid()), "--", *argv]


def nats_nodes(net: HostNetwork, store_root: Path) -> dict[str, NatsServer]:
    """One clustered JetStream node per NATS host, each binding its host's address."""
    return {
        host: NatsServer(
            NATS_PORT,
            host=net.address(host),
            store_dir=store_root / host,
            monitor_port=MONITOR_PORT,
            launcher=net.launcher(host),
            cluster=ClusterMembership(
                cluster_name="multihost",
                server_name=host,
                route_host=net.address(host),
                route_port=ROUTE_PORT,
                routes=tuple(
                    f"nats-route://{net.address(other)}:{ROUTE_PORT}"
                    for other in NATS_HOSTS
                    if other != host
                ),
            ),
        )
        for host in NATS_HOSTS
    }


def wait_for_metadata_leader(nodes: Sequence[NatsServer], timeout: float) -> None:
    """Until the nodes agree on a JetStream metadata leader and all report healthy:
    before that, creating a replicated bucket fails ("no suitable peers")."""

    def agreed() -> bool:
        leaders = set()
        for node in nodes:
            meta = (node.monitor("/jsz") or {}).get("meta_cluster")
            leaders.add(meta.get("leader") if isinstance(meta, dict) else None)
        healthy = all(node.monitor("/healthz") == {"status": "ok"} for node in nodes)
        return healthy and len(leaders) == 1 and None not in leaders

    wait_until(agreed, timeout=timeout, interval=0.1, what="a JetStream metadata leader")


@pytest.fixture(scope="module")
def topology(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    reason = netns.available()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable here: {reason}")
    netns.sweep_stale()
    logs = tmp_path_factory.mktemp("multihost")
    namespace = "mh" + uuid.uuid4().hex[:8]
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(HostNetwork(HOSTS))
        nodes = nats_nodes(net, logs / "nats")
        for node in nodes.values():
            stack.callback(node.stop)
        procs: list[ManagedProcess] = []
        stack.callback(_stop_all, procs)
        # Links first (callbacks run last-in first-out): a process stopping over a cut
        # link would wait for a broker it cannot reach.
        stack.callback(lambda: [net.restore(host) for host in HOSTS if net.is_cut(host)])

        for node in nodes.values():
            node.spawn()
        for node in nodes.values():
            node.wait_ready(20)
        wait_for_metadata_leader(list(nodes.values()), timeout=30)
        url = ",".join(node.url for node in nodes.values())
        common = ["--nats-server", url, "--nats-replicas", "3"]
        for host in WORKER_HOSTS:
            argv = [
                sys.executable, "-m", "dynamo.mocker",
                "--model", str(embedded_model),
                "--served-model-name", MODEL,
                "--namespace", namespace,
                *common,
                "--speed-up", "20",
            ]  # fmt: skip
            if host == CUT_WORKER:
                argv += ["--lease-ttl", str(LEASE_TTL_S)]
            procs.append(ManagedProcess(host, in_host(net, host, argv), logs))
        argv = frontend_argv(HTTP_PORT, url, namespace, "--router-mode", "kv", *common[2:])
        argv += ["--first-token-timeout", str(FIRST_TOKEN_TIMEOUT_S)]
        argv += ["--http-host", net.address("frontend")]  # the last --http-host wins
        frontend = ManagedProcess("frontend", in_host(net, "frontend", argv), logs)
        procs.append(frontend)
        workers = dict(zip(WORKER_HOSTS, procs[: len(WORKER_HOSTS)], strict=True))
        topo = Topology(net, nodes, frontend, workers, namespace)
        wait_serving(topo.base_url, MODEL, procs, timeout=90, interval=0.3)
        wait_while_alive(
            lambda: len(topo.routable_workers()) == len(WORKER_HOSTS),
            procs,
            timeout=30,
            interval=0.25,
            what="the kv router to see both workers",
        )
        # A worker is routable before its model card is published (the card waits for
        # its tokenizer's upload); one cut off half way through that fails to start.
        wait_while_alive(
            lambda: asyncio.run(registered_cards(topo)) == len(WORKER_HOSTS),
            procs,
            timeout=60,
            interval=0.25,
            what="both workers' model cards",
            retry_on=(nats.errors.Error, TimeoutError),
        )
        yield topo
    # Nothing the network made outlives the module: namespaces, veths, bridge.
    assert not net.leftovers(), net.leftovers()


async def registered_cards(topo: Topology) -> int:
    """The model cards this test's workers published, read from the registry's stream
    (its leader's count of live keys per subject)."""
    nc = await nats.connect(servers=topo.nats_url.split(","))
    try:
        info = await nc.jetstream().stream_info(
            "KV_dyn_models", subjects_filter=f"$KV.dyn_models.{topo.namespace}.>"
        )
        return len(info.state.subjects or {})
    finally:
        await nc.close()


async def cluster_whole(topo: Topology) -> bool:
    """Every stream in `STREAMS` has a leader whose two followers are current."""
    nc = await nats.connect(servers=topo.nats_url.split(","), connect_timeout=2)
    try:
        js = nc.jetstream(timeout=2)
        for stream in STREAMS:
            cluster = (await js.stream_info(stream)).cluster
            replicas = (cluster.replicas or []) if cluster else []
            if not cluster or not cluster.leader or len(replicas) != 2:
                return False
            if not all(peer.current for peer in replicas):
                return False
        return True
    finally:
        await nc.close()


def wait_settled(topo: Topology, timeout: float) -> float:
    """Seconds until every node is healthy with one metadata leader and `cluster_whole`
    has held for `SETTLED_FOR_S`."""
    since: list[float] = []

    def settled() -> bool:
        nodes = list(topo.nodes.values())
        healthy = all(node.monitor("/healthz") == {"status": "ok"} for node in nodes)
        if not (healthy and asyncio.run(cluster_whole(topo))):
            since.clear()
            return False
        since[:] = since or [time.monotonic()]
        return time.monotonic() - since[0] >= SETTLED_FOR_S

    return wait_until(
        settled,
        timeout=timeout,
        interval=0.2,
        what="the NATS cluster to be whole again",
        retry_on=(nats.errors.Error, TimeoutError),
    )


def _stop_all(procs: list[ManagedProcess]) -> None:
    """SIGTERM to every process at once, then wait for each (workers deregister)."""
    for proc in procs:
        proc.terminate()
    for proc in reversed(procs):
        proc.stop(timeout=15)


def chat(topo: Topology, prompt: str) -> tuple[int, float, str]:
    """A non-streamed chat request through the bridge: status, seconds, body."""
    started = time.monotonic()
    try:
        status, body = http_post_json(
            f"{topo.base_url}/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12},
            timeout=REQUEST_TIMEOUT_S,
        )
    except OSError as exc:
        status, body = 0, repr(exc)
    return status, time.monotonic() - started, body


def answer_text(body: str) -> str:
    return json.loads(body)["choices"][0]["message"]["content"]


_POST_FROM_INSIDE = """
import os, sys, urllib.request
request = urllib.request.Request(
    os.environ["URL"], data=sys.stdin.read().encode(), headers={"Content-Type": "application/json"}
)
with urllib.request.urlopen(request, timeout=30) as response:
    print(response.status, response.read().decode())
"""
"""A chat request sent by a program inside a host (status, a space, the body)."""


def connections(node: NatsServer) -> list[dict]:
    """The node's client connections (`/connz`), empty when it does not answer."""
    connz = node.monitor("/connz?limit=1024") or {}
    return list(connz.get("connections", []))


def node_of(topo: Topology, pid: int) -> str:
    """The NATS host holding the connection(s) of process `pid` (its server name is the
    host's name)."""
    node = node_holding(topo.nodes.values(), pid)
    assert node.cluster is not None
    return node.cluster.server_name


async def move_leaders_off(topo: Topology, victim: str) -> None:
    """Make another node lead every stream in `STREAMS` that `victim` leads, and wait
    until that holds. The cut then costs these streams no election while it lasts
    (test_nats_cluster.py covers the loss of a stream leader); `CUT_WORKER`'s short lease
    would not outlive one."""
    successor = next(host for host in NATS_HOSTS if host != victim)
    await prefer_stream_leaders(
        topo.nats_url, STREAMS, successor, settled=lambda leader: leader != victim
    )


def test_a_request_through_the_bridge_is_served_by_hosts_apart(topology: Topology) -> None:
    status, _, body = chat(topology, "Hello from another host")
    assert status == 200, body
    assert answer_text(body), body

    # And from inside the frontend's own host, as a client beside it would send it.
    inside = subprocess.run(
        [*topology.net.launcher("frontend"), sys.executable, "-c", _POST_FROM_INSIDE],
        input=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        env={**os.environ, "URL": f"{topology.base_url}/v1/chat/completions"},
        capture_output=True,
        text=True,
        timeout=REQUEST_TIMEOUT_S + 10,
    )
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.startswith("200 "), inside.stdout
    assert answer_text(inside.stdout[4:]), inside.stdout

    # Each component's connection comes from its own host's address.
    addresses = {topology.net.address(h) for h in ("frontend", *WORKER_HOSTS)}
    seen = {c.get("ip") for node in topology.nodes.values() for c in connections(node)}
    assert addresses <= seen, (addresses, seen)
    assert "127.0.0.1" not in seen, seen


def test_cutting_the_frontends_nats_node_keeps_serving(topology: Topology) -> None:
    victim = node_of(topology, topology.frontend_pids()[0])
    placement = {host: node_of(topology, proc.pid) for host, proc in topology.workers.items()}
    asyncio.run(move_leaders_off(topology, victim))
    results: list[tuple[int, float, str]] = []
    cut_at = time.monotonic()
    topology.net.cut(victim)
    try:
        for i in range(REQUESTS_PER_PHASE):
            results.append(chat(topology, f"Question {i} while {victim} is unreachable"))
        moved_after = time.monotonic() - cut_at
        # By now the frontend serves through another node.
        assert all(node_of(topology, pid) != victim for pid in topology.frontend_pids())
    finally:
        topology.net.restore(victim)
    during = list(results)
    settled_after = wait_settled(topology, timeout=60)
    # A worker whose lease lapsed meanwhile (its heartbeats went nowhere until it noticed
    # the silent connection, or the rejoining node's elections held the registry) puts
    # its keys again on a node it reaches.
    rejoined_after = wait_until(
        lambda: len(topology.routable_workers()) == len(WORKER_HOSTS),
        timeout=REJOIN_TIMEOUT_S,
        interval=0.1,
        retry_on=(KeyError,),
        what="both workers in routing after the NATS node came back",
    )
    for i in range(REQUESTS_PER_PHASE):
        results.append(chat(topology, f"Question {i} after {victim} is back"))
    failures = [(status, body[:300]) for status, _, body in results if status != 200]
    assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:3]}"
    slowest = max(latency for _, latency, _ in during)
    print(
        f"\ncut {victim} (the frontend's node; workers on {placement}): "
        f"{len(during)} requests during the cut, "
        f"slowest {slowest:.2f}s, all done {moved_after:.1f}s after the cut; "
        f"cluster whole again {settled_after:.1f}s after restoring, both workers routable "
        f"{rejoined_after:.1f}s later; "
        f"{len(results) - len(during)} requests after that, slowest "
        f"{max(latency for _, latency, _ in results[len(during) :]):.2f}s"
    )


def test_cutting_a_workers_link_removes_it_within_two_lease_ttls(topology: Topology) -> None:
    # Both workers are routable before the cut.
    wait_until(
        lambda: len(topology.routable_workers()) == 2,
        timeout=REJOIN_TIMEOUT_S,
        interval=0.1,
        retry_on=(KeyError,),
        what="both workers in routing",
    )
    before = set(topology.live_workers())
    victim, survivor = CUT_WORKER, STEADY_WORKER
    cut_at = time.monotonic()
    topology.net.cut(victim)
    wait_until(
        lambda: len(topology.live_workers()) == 1,
        timeout=4 * LEASE_TTL_S,
        interval=0.05,
        retry_on=(KeyError,),
        what=f"{victim} to leave routing",
    )
    removed_after = time.monotonic() - cut_at
    # The key expires one TTL after the last heartbeat that arrived (a beat goes every
    # TTL/3), i.e. within one TTL of the cut; the broker's expiry and the watch's
    # delivery to the frontend add well under a second. 2x TTL is the claim; the
    # 0.2 s is this poll's interval and the HTTP round trip of the observation.
    assert removed_after <= 2 * LEASE_TTL_S + 0.2, removed_after
    (remaining,) = topology.live_workers()
    assert remaining in before

    routed_before = topology.routed()
    results = [chat(topology, f"After {victim} went, question {i}") for i in range(4)]
    assert all(status == 200 for status, _, _ in results), [r[2][:200] for r in results]
    routed_after = topology.routed()
    grew = {w for w in routed_after if routed_after[w] > routed_before.get(w, 0)}
    assert grew == {remaining}, (routed_before, routed_after)

    topology.net.restore(victim)
    back_after = wait_until(
        lambda: len(topology.routable_workers()) == 2,
        timeout=30,
        interval=0.1,
        retry_on=(KeyError,),
        what=f"{victim} to come back once its link is restored",
    )
    print(
        f"\ncut {victim}: left routing after {removed_after:.2f}s "
        f"(lease TTL {LEASE_TTL_S:g}s, limit {2 * LEASE_TTL_S:g}s); back "
        f"{back_after:.2f}s after its link was restored; survivor {survivor}"
    )
