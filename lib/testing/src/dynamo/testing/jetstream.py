"""Steering a test NATS cluster: which node holds a process's connection, and moving a
stream's leadership to a chosen node (so a test can decide what losing a node costs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterable, Sequence

import nats
import nats.errors
from nats.js import JetStreamContext

from dynamo.nats_server import NatsServer

ELECTION_TRIES = 4
"""Stream info requests (5 s each) tried while a stream elects a leader: longer than the
9 s an election can take."""


def holds_connection_of(node: NatsServer, pid: int) -> bool:
    """Whether `node` lists a client connection of process `pid` (a runtime names its
    connection `<name>-<pid>`; network namespaces keep pids). False when the node does
    not answer its monitoring port."""
    connz = node.monitor("/connz?limit=1024") or {}
    names = (str(conn.get("name", "")) for conn in connz.get("connections", []))
    return any(name.endswith(f"-{pid}") for name in names)


def node_holding(nodes: Iterable[NatsServer], pid: int) -> NatsServer:
    """The node holding process `pid`'s connection; AssertionError when none does."""
    for node in nodes:
        if holds_connection_of(node, pid):
            return node
    raise AssertionError(f"no NATS node lists a connection of process {pid}")


async def prefer_stream_leaders(
    url: str,
    streams: Sequence[str],
    preferred: str,
    *,
    settled: Callable[[str | None], bool] | None = None,
    attempts: int = 100,
) -> None:
    """Step each stream's leader down with `preferred` (a server name) as the wished-for
    successor until `settled(leader)` holds (by default: `preferred` leads), then check
    it; AssertionError when it does not settle within `attempts` tries."""
    done = settled or (lambda leader: leader == preferred)
    request = json.dumps({"placement": {"preferred": preferred}}).encode()
    nc = await nats.connect(servers=url.split(","))
    try:
        js = nc.jetstream()
        for stream in streams:
            for _ in range(attempts):
                if (leader := await _leader(js, stream)) is not None and done(leader):
                    break
                with contextlib.suppress(Exception):
                    await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, timeout=5)
                await asyncio.sleep(0.1)
            leader = await _leader(js, stream)
            assert leader is not None and done(leader), (stream, leader)
    finally:
        await nc.close()


async def _leader(js: JetStreamContext, stream: str) -> str | None:
    """The stream's leader; None while none answers: a stream info request times out
    while the stream elects a leader after a step-down (4 to 9 s), so a timeout here
    means "not settled yet", not a failure."""
    for _ in range(ELECTION_TRIES):
        try:
            return (await js.stream_info(stream)).cluster.leader
        except nats.errors.TimeoutError:
            continue
    return None
