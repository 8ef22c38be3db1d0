"""An instance that answered "no responders" is left out of routing briefly, not for a
whole lease TTL.

A worker whose NATS connection dropped has no subscription until it reconnects (about a
second on a cluster); its instance key, put again unchanged, brings the client no event.
Left out for a lease TTL (18 s on a cluster), the only worker of a model was a 503 for that
long (seen in the chaos soak after a NATS node restart). Now: 0.5 s, doubling with each
failed probe in a row up to `SUSPECT_MAX_S`, reset once it answers or re-registers; the
answers of requests sent before the pause began are not probes (many requests meeting one
reconnecting worker at once counted as many strikes, and left it out for the whole lease:
seen when a NATS cluster lost the node of both the frontend and the worker). And
`wait_routable` wakes when the first pause ends.

The runtime here is a stand-in that only hands the client its discovery callbacks (the
watch's contract); the clock is the test's, except in the `wait_routable` tests, which
wait for real.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import dynamo.runtime.client as client_module
from dynamo.runtime import naming, wire
from dynamo.runtime.client import SUSPECT_FIRST_S, SUSPECT_MAX_S, Client
from dynamo.runtime.runtime import Endpoint

LEASE_TTL_S = 18.0
INSTANCE = 0x1234


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class WatchOnlyRuntime:
    """What `Client.__init__` asks of a runtime; keeps the watch's `on_put`."""

    lease_ttl = LEASE_TTL_S

    def __init__(self) -> None:
        self.on_put: Callable[[str, bytes], None] | None = None

    def watch_bucket(self, _bucket: str, _filter: str, **callbacks: Any) -> object:
        self.on_put = callbacks["on_put"]
        return object()

    def add_disconnect_listener(self, _listener: object) -> None:
        pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(client_module, "time", fake)
    return fake


def registered_client() -> tuple[Client, WatchOnlyRuntime]:
    runtime = WatchOnlyRuntime()
    endpoint = Endpoint(runtime, "ns", "backend", "generate")  # type: ignore[arg-type]
    client = Client(runtime, endpoint)  # type: ignore[arg-type]
    put_instance(runtime)
    assert client.routable_ids() == [INSTANCE]
    return client, runtime


def put_instance(runtime: WatchOnlyRuntime, instance: int = INSTANCE) -> None:
    info = wire.InstanceInfo("ns", "backend", "generate", instance, "subject", started_at=1.0)
    assert runtime.on_put is not None
    runtime.on_put(
        naming.instance_key("ns", "backend", "generate", instance), wire.encode_instance(info)
    )


def test_one_no_responders_leaves_the_instance_out_for_half_a_second(clock: Clock) -> None:
    client, _ = registered_client()
    client.mark_unreachable(INSTANCE)
    assert client.routable_ids() == []
    clock.now += SUSPECT_FIRST_S - 0.01
    assert client.routable_ids() == []
    clock.now += 0.02
    assert client.routable_ids() == [INSTANCE]


def test_failed_probes_in_a_row_double_the_pause_up_to_its_bound(clock: Clock) -> None:
    client, _ = registered_client()
    pauses = []
    for _ in range(8):
        client.mark_unreachable(INSTANCE)
        start = clock.now
        while not client.routable_ids():
            clock.now += 0.25
        pauses.append(clock.now - start)
    assert pauses[:3] == [0.5, 1.0, 2.0]
    assert pauses[-1] == SUSPECT_MAX_S < LEASE_TTL_S


def test_answers_to_requests_sent_before_the_pause_are_not_probes(clock: Clock) -> None:
    """Twenty requests in flight when the worker's subscription vanished all answer "no
    responders": one strike, so it is probed again after the first pause."""
    client, _ = registered_client()
    for _ in range(20):
        client.mark_unreachable(INSTANCE)
        clock.now += 0.01
    clock.now += SUSPECT_FIRST_S
    assert client.routable_ids() == [INSTANCE]


async def test_wait_routable_wakes_when_the_first_pause_ends() -> None:
    client, _ = registered_client()
    client.mark_unreachable(INSTANCE)
    assert client.routable_ids() == []
    assert await client.wait_routable(timeout=30.0)
    assert client.routable_ids() == [INSTANCE]


async def test_wait_routable_answers_false_at_once_without_instances() -> None:
    runtime = WatchOnlyRuntime()
    endpoint = Endpoint(runtime, "ns", "backend", "generate")  # type: ignore[arg-type]
    client = Client(runtime, endpoint)  # type: ignore[arg-type]
    assert not await client.wait_routable(timeout=30.0)


async def test_wait_routable_gives_up_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "SUSPECT_FIRST_S", 60.0)
    monkeypatch.setattr(client_module, "SUSPECT_MAX_S", 60.0)
    client, _ = registered_client()
    client.mark_unreachable(INSTANCE)  # paused for a minute
    assert not await client.wait_routable(timeout=0.05)
    assert client.routable_ids() == []


def test_an_answer_or_a_new_registration_starts_the_count_again(clock: Clock) -> None:
    client, runtime = registered_client()
    for _ in range(5):
        client.mark_unreachable(INSTANCE)
    client.mark_reachable(INSTANCE)
    client.mark_unreachable(INSTANCE)
    clock.now += SUSPECT_FIRST_S
    assert client.routable_ids() == [INSTANCE]
    client.mark_unreachable(INSTANCE)  # a strike after the reset: 1 s now
    put_instance(runtime)  # the instance registered again: routable at once, count reset
    assert client.routable_ids() == [INSTANCE]
    client.mark_unreachable(INSTANCE)
    clock.now += SUSPECT_FIRST_S
    assert client.routable_ids() == [INSTANCE]


async def test_wait_routable_waits_for_an_instance_outside_those_excluded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request already lost on one instance waits for the paused other one, not for
    the one it may not use (which is routable)."""
    monkeypatch.setattr(client_module, "SUSPECT_FIRST_S", 60.0)
    monkeypatch.setattr(client_module, "SUSPECT_MAX_S", 60.0)
    client, runtime = registered_client()
    other = INSTANCE + 1
    put_instance(runtime, other)
    client.mark_unreachable(other)
    assert client.routable_ids() == [INSTANCE]
    assert await client.wait_routable(timeout=30.0, excluding={other})
    assert not await client.wait_routable(timeout=0.05, excluding={INSTANCE})
    assert not await client.wait_routable(timeout=30.0, excluding={INSTANCE, other})
