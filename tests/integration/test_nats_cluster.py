"""The system on a three-node NATS JetStream cluster, and the loss of one node under load.

A real cluster (`NatsCluster`: three `nats-server` processes routed together), a kv-mode
frontend and a mocker process with two workers, all given the three URLs and
`--nats-replicas 3`. Under a steady load of streamed requests, the node the frontend is
connected to is SIGKILLed. Claims:

* no request fails: the frontend and the workers reconnect to the other nodes, a
  request whose stream was cut is placed again or migrated by the frontend, and one that
  meets a worker still reconnecting ("no responders") waits for it; every client is
  answered again within a lease TTL of the new leaders (a margin for loaded hosts: CI
  once saw the workers unreachable for several seconds);
* no registration is lost: the registry's and the KV-event stream's leaders are moved to
  the victim first, so the kill costs them a JetStream election (4-9 s without writes);
  the cluster lease (18 s) outlives it, so the router never drops a worker and the
  registry still holds both workers' keys;
* no KV event is lost: once the load stops, the router has been delivered every event the
  (replicated) stream holds, sequence for sequence, and the stream has no gap;
* the buckets and the stream really have three replicas, and a component asking for three
  replicas from a single server exits with a clear error instead of running unreplicated.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest

from dynamo.llm.kv_router.subjects import KV_EVENTS_STREAM
from dynamo.nats_server import NatsCluster, NatsServer
from dynamo.testing.http import http_post_json, kv_router_views
from dynamo.testing.jetstream import node_holding, prefer_stream_leaders
from dynamo.testing.mocker_command_line import mocker_argv
from dynamo.testing.processes import FrontendProcess, ManagedProcess, running, wait_serving
from dynamo.testing.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "cluster-model"
LOAD_CLIENTS = 4
RECOVERY_S = 30.0  # a cluster lease (18 s) and a margin for a loaded host
REGISTRY_STREAM = "KV_dyn_instances"
MODELS_STREAM = "KV_dyn_models"


@dataclass
class Stack:
    cluster: NatsCluster
    frontend: FrontendProcess
    mocker: ManagedProcess
    namespace: str

    @property
    def endpoint_path(self) -> str:
        return f"{self.namespace}/backend/generate"

    def logs(self) -> str:
        """The tails of the frontend's and the mocker's logs, for a failure message."""
        return "\n".join(
            f"--- {proc.name}\n{proc.log_tail(40)}" for proc in (self.frontend, self.mocker)
        )

    def routers(self) -> list[dict]:
        """The KV router of each frontend process (one, or N with `--http-workers N`)."""
        return kv_router_views(self.frontend.base_url, MODEL, self.endpoint_path)


@pytest.fixture(scope="module")
def stack(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("cluster")
    namespace = "clu" + uuid.uuid4().hex[:8]
    with NatsCluster(3, store_root=logs / "nats") as cluster, running([]) as procs:
        argv = mocker_argv(
            embedded_model, cluster.url, namespace,
            "--nats-replicas", "3",
            "--num-workers", "2",
            "--speed-up", "20",
            served_model_name=MODEL,
        )  # fmt: skip
        mocker = ManagedProcess("mocker", argv, logs)
        procs.append(mocker)
        frontend = FrontendProcess(
            "frontend",
            cluster.url,
            logs,
            namespace=namespace,
            extra=["--router-mode", "kv", "--nats-replicas", "3"],
        )
        procs.append(frontend)
        # Both logs on a timeout: a model that never appears is usually the mocker's story.
        wait_serving(frontend.base_url, MODEL, [frontend, mocker], timeout=90)
        frontend.wait_kv_router_workers(MODEL, f"{namespace}/backend/generate", 2)
        yield Stack(cluster, frontend, mocker, namespace)


def chat(stack: Stack, prompt: str, max_tokens: int = 24) -> tuple[int, str]:
    return http_post_json(
        f"{stack.frontend.base_url}/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
        },
        timeout=30,
    )


def tenant_prompt(tenant: int, turn: int) -> str:
    """A shared prefix per tenant (so KV events and overlaps matter), a new question."""
    facts = " ".join(f"t{tenant}-fact-{i}" for i in range(40))
    return f"Tenant {tenant} knows: {facts}. Question {turn}: what follows?"


@dataclass
class Load:
    """`LOAD_CLIENTS` threads sending streamed chat requests back to back until stopped;
    every answer's status and latency is kept."""

    stack: Stack
    results: list[tuple[int, float, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for client in range(LOAD_CLIENTS):
            thread = threading.Thread(target=self._run, args=(client,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _run(self, client: int) -> None:
        turn = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                status, body = chat(self.stack, tenant_prompt(client * 7 + turn % 3, turn))
            except OSError as exc:
                status, body = 0, repr(exc)
            self.results.append((status, time.monotonic() - started, body))
            turn += 1

    def finish(self) -> list[tuple[int, float, str]]:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        return self.results


async def lead_from(cluster: NatsCluster, node: NatsServer, streams: tuple[str, ...]) -> None:
    """Make `node` the leader of `streams` and wait until that holds: losing it then costs
    each of them an election. (Moving the metadata leader needs the system account; it is
    on the victim in about one run of three, which makes the stream elections slower
    still.)"""
    assert node.cluster is not None
    await prefer_stream_leaders(cluster.url, streams, node.cluster.server_name, attempts=50)


async def wait_for_leaders(url: str, streams: tuple[str, ...], timeout: float = 20.0) -> float:
    """Seconds until every stream answers with a leader again (after a node loss)."""
    nc = await nats.connect(servers=url.split(","))
    started = time.monotonic()
    try:
        js = nc.jetstream(timeout=0.5)
        for stream in streams:
            while True:
                with contextlib.suppress(Exception):
                    if (await js.stream_info(stream)).cluster.leader:
                        break
                assert time.monotonic() - started < timeout, f"{stream} has no leader"
                await asyncio.sleep(0.1)
        return time.monotonic() - started
    finally:
        await nc.close()


async def replicated_state(url: str, namespace: str) -> dict[str, object]:
    """Replica counts, the KV-event stream's sequences and the registry keys of this
    test's namespace, read from the cluster directly."""
    nc = await nats.connect(servers=url.split(","))
    try:
        js = nc.jetstream()
        stream = await js.stream_info(KV_EVENTS_STREAM)
        # The stream leader's own count of live keys per subject (a watch-based
        # `kv.keys()` can come back empty while consumers catch up after a failover).
        instances = await js.stream_info(
            REGISTRY_STREAM, subjects_filter=f"$KV.dyn_instances.{namespace}.>"
        )
        keys = list(instances.state.subjects or {})
        return {
            "stream_replicas": stream.config.num_replicas,
            "registry_replicas": instances.config.num_replicas,
            "first_seq": stream.state.first_seq,
            "last_seq": stream.state.last_seq,
            "messages": stream.state.messages,
            "generate_keys": len([k for k in keys if ".backend.generate." in k]),
        }
    finally:
        await nc.close()


def test_serves_with_every_bucket_and_stream_replicated_three_times(stack: Stack) -> None:
    status, body = chat(stack, "Hello cluster")
    assert status == 200, body
    state = asyncio.run(replicated_state(stack.cluster.url, stack.namespace))
    assert state["stream_replicas"] == 3
    assert state["registry_replicas"] == 3
    assert state["generate_keys"] == 2


def test_losing_the_frontends_nats_node_under_load_loses_nothing(stack: Stack) -> None:
    victim = node_holding(stack.cluster.nodes, stack.frontend.serving_pids()[0])
    streams = (REGISTRY_STREAM, MODELS_STREAM, KV_EVENTS_STREAM)
    asyncio.run(lead_from(stack.cluster, victim, streams))
    feeds_before = [router["feed"] for router in stack.routers()]
    load = Load(stack).start()
    time.sleep(2.0)
    before = len(load.results)
    assert before > 0, "no answer before the kill"
    victim.kill()
    survivors = ",".join(node.url for node in stack.cluster.nodes if node.running)
    election_s = asyncio.run(wait_for_leaders(survivors, streams))
    time.sleep(3.0)  # a heartbeat and a few requests on the new leaders
    # Serving again: every client had answers after the kill (bounded by a lease TTL and
    # a margin, not by the 3 s above: a loaded host may take longer to reconnect).
    served_after = wait_until(
        lambda: len(load.results) >= before + 2 * LOAD_CLIENTS,
        timeout=RECOVERY_S,
        what=lambda: (
            f"answers after the kill ({len(load.results) - before} so far)\n" + stack.logs()
        ),
    )
    results = load.finish()
    failures = [(status, body[:300]) for status, _, body in results if status != 200]
    assert not failures, (
        f"{len(failures)} of {len(results)} requests failed: {failures[:3]}\n{stack.logs()}"
    )
    slowest = max(latency for _, latency, _ in results[before:])
    print(
        f"\n{len(results)} requests, {len(results) - before} after the kill, slowest "
        f"{slowest:.2f}s; new stream leaders after {election_s:.1f}s, serving again "
        f"{served_after:.1f}s after that"
    )

    # Registrations: the router never dropped a worker; the registry holds both keys.
    for router, feed_before in zip(stack.routers(), feeds_before, strict=True):
        feed = router["feed"]
        assert feed["workers_removed"] == feed_before["workers_removed"], feed
        assert len(feed["live_workers"]) == 2
    # (A read just after the elections may come back empty while the new leader's
    # consumers catch up: the keys are read until they show, for a few seconds.)
    wait_until(
        lambda: asyncio.run(replicated_state(survivors, stack.namespace))["generate_keys"] == 2,
        timeout=5,
        interval=0.2,
        what="both workers' keys in the registry",
        retry_on=(nats.errors.Error,),
    )

    # KV events: the router's ordered subscription (which checks its own sequence) is
    # delivered the stream's last event (events still trickle in as the last requests
    # end: both are read afresh each time), and events kept coming after the kill.
    def router_caught_up() -> bool:
        last = asyncio.run(replicated_state(survivors, stack.namespace))["last_seq"]
        return all(router["feed"]["last_sequence"] == last for router in stack.routers())

    wait_until(router_caught_up, timeout=10, interval=0.2, what="the router's KV events")
    for router, feed_before in zip(stack.routers(), feeds_before, strict=True):
        feed = router["feed"]
        assert feed["events"] > feed_before["events"] and feed["events_malformed"] == 0, feed
        assert feed["stream_resets"] == feed_before["stream_resets"], feed

    # And the stack still serves, on the two surviving nodes.
    status, body = chat(stack, "Still there?")
    assert status == 200, body


def test_asking_a_single_server_for_three_replicas_is_a_clear_error(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    argv = mocker_argv(
        embedded_model, nats_url, "rep" + uuid.uuid4().hex[:8],
        "--nats-replicas", "3",
    )  # fmt: skip
    mocker = ManagedProcess("mocker", argv, tmp_path)
    assert mocker.popen.wait(60) == 2
    last = mocker.log_tail().strip().splitlines()[-1]
    assert last.startswith("error: NATS cannot create"), last
    assert "--nats-replicas" in last and "3 replicas" in last
