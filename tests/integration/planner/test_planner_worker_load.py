"""The planner's worker load watcher against a real nats-server and the workers' own
`LoadPublisher`.

Claims: each pool's load is its workers' latest reports folded together (sums, the mean KV
usage, the smallest positive block count, the K most workers run), pools on different
components are kept apart, a report older than `stale_after_s` is left out (a worker that
stopped publishing, e.g. one that left, ages out; a later report brings it back), an idle
worker keeps re-reporting and so stays counted, and malformed reports are counted, never
raised. The watcher's clock is a `FakeClock`: reports are stamped when they arrive and
time moves only when the test moves it, so staleness never depends on the machine's speed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NatsClient

from dynamo.llm.kv_router.publisher import LoadPublisher
from dynamo.llm.kv_router.subjects import load_metrics_subject
from dynamo.llm.protocols import LoadMetrics, encode
from dynamo.planner.observation import PoolLoad
from dynamo.planner.pools import PoolRole
from dynamo.planner.worker_load import WorkerLoadWatcher, pool_load
from dynamo.testing.clocks import FakeClock
from dynamo.testing.waiting import wait_until_async

pytestmark = pytest.mark.integration

PREFILL = "prefill"
DECODE = "backend"
STALE_AFTER_S = 5.0
ARRIVAL_TIMEOUT_S = 10.0  # a hang guard only


@pytest.fixture
def namespace() -> str:
    return "planner" + uuid.uuid4().hex[:8]


@pytest.fixture
async def workers_nc(nats_url: str) -> AsyncIterator[NatsClient]:
    """The workers' connection (one for all: a connection's messages arrive in order)."""
    nc = await nats.connect(nats_url)
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def watcher(
    nats_url: str, namespace: str, clock: FakeClock
) -> AsyncIterator[WorkerLoadWatcher]:
    nc = await nats.connect(nats_url)
    watching = WorkerLoadWatcher(
        nc,
        namespace,
        {PoolRole.PREFILL: PREFILL, PoolRole.DECODE: DECODE},
        STALE_AFTER_S,
        clock=clock,
    )
    await watching.start()
    try:
        yield watching
    finally:
        await watching.close()
        await watching.close()  # idempotent
        await nc.close()


async def report(nc: NatsClient, namespace: str, component: str, metrics: LoadMetrics) -> None:
    """One report, published by the workers' own `LoadPublisher`."""
    publisher = LoadPublisher(nc, namespace, component, metrics.worker_id, lambda: metrics)
    assert await publisher.publish_if_due(force=True)


async def arrived(watcher: WorkerLoadWatcher, reports: int) -> None:
    await wait_until_async(
        lambda: watcher.stats.reports >= reports,
        timeout=ARRIVAL_TIMEOUT_S,
        what=lambda: f"{reports} load reports (got {watcher.stats.reports})",
    )


async def test_pools_fold_their_workers_latest_reports(
    watcher: WorkerLoadWatcher, workers_nc: NatsClient, namespace: str
) -> None:
    decode = [
        LoadMetrics(1, 9, 9, 0, 1000, 0.9, num_speculative_tokens=3),  # replaced below
        LoadMetrics(2, 5, 0, 0, 800, 0.3, num_speculative_tokens=3),
        LoadMetrics(3, 1, 2, 0, 0, 0.1, num_speculative_tokens=1),  # blocks unknown
        LoadMetrics(4, 0, 0, 0, 900, 0.2),  # K not said
        LoadMetrics(1, 3, 1, 0, 1000, 0.5, num_speculative_tokens=3),  # worker 1's latest
    ]
    prefill = [LoadMetrics(7, 2, 4, 0, 2000, 0.6)]
    for metrics in decode:
        await report(workers_nc, namespace, DECODE, metrics)
    for metrics in prefill:
        await report(workers_nc, namespace, PREFILL, metrics)
    await arrived(watcher, len(decode) + len(prefill))

    assert watcher.load(PoolRole.DECODE) == PoolLoad(
        workers=4,
        active_requests=3 + 5 + 1 + 0,
        waiting_requests=1 + 0 + 2 + 0,
        mean_kv_usage=pytest.approx((0.5 + 0.3 + 0.1 + 0.2) / 4),
        total_blocks=800,
        k_in_force=3,
        token_weighted_batch=pytest.approx((9 + 25 + 1) / 9),  # sum of b^2 over sum of b
    )
    assert watcher.load(PoolRole.PREFILL) == PoolLoad(
        workers=1,
        active_requests=2,
        waiting_requests=4,
        mean_kv_usage=pytest.approx(0.6),
        total_blocks=2000,
        k_in_force=None,
        token_weighted_batch=2.0,
    )
    assert watcher.load(PoolRole.DECODE).mean_active == pytest.approx(9 / 4)
    assert watcher.stats.malformed == 0


async def test_stale_reports_are_left_out(
    watcher: WorkerLoadWatcher, workers_nc: NatsClient, namespace: str, clock: FakeClock
) -> None:
    await report(workers_nc, namespace, DECODE, LoadMetrics(1, active_requests=2))
    await arrived(watcher, 1)
    clock.now += 3.0
    await report(workers_nc, namespace, DECODE, LoadMetrics(2, active_requests=5))
    await arrived(watcher, 2)

    clock.now += STALE_AFTER_S - 3.0  # worker 1's report is exactly stale_after_s old
    assert watcher.load(PoolRole.DECODE).workers == 2
    clock.now += 0.5
    assert watcher.load(PoolRole.DECODE) == PoolLoad(
        workers=1, active_requests=5, token_weighted_batch=5.0
    )

    await report(workers_nc, namespace, DECODE, LoadMetrics(1, active_requests=2))
    await arrived(watcher, 3)
    assert watcher.load(PoolRole.DECODE) == PoolLoad(
        workers=2, active_requests=7, token_weighted_batch=pytest.approx(29 / 7)
    )
    clock.now += STALE_AFTER_S + 1.0
    assert watcher.load(PoolRole.DECODE) == PoolLoad()


async def test_an_idle_worker_stays_counted(
    watcher: WorkerLoadWatcher, workers_nc: NatsClient, namespace: str
) -> None:
    """An unchanged load is re-published at every heartbeat: an idle live worker is not
    mistaken for a departed one."""
    idle = LoadMetrics(5, total_blocks=100)
    publisher = LoadPublisher(workers_nc, namespace, DECODE, 5, lambda: idle, interval_s=0.05)
    await publisher.start()
    try:
        await arrived(watcher, 3)  # the first report, then heartbeats of the same load
    finally:
        await publisher.stop()
    assert watcher.load(PoolRole.DECODE) == PoolLoad(workers=1, total_blocks=100)


async def test_a_worker_that_left_ages_out(
    watcher: WorkerLoadWatcher, workers_nc: NatsClient, namespace: str, clock: FakeClock
) -> None:
    leaving = LoadMetrics(8, active_requests=1)
    publisher = LoadPublisher(workers_nc, namespace, DECODE, 8, lambda: leaving)
    await publisher.start()
    await arrived(watcher, 1)
    await publisher.stop()  # what a worker's graceful shutdown does: nothing more is sent
    # A later report on the same connection: once it has arrived, so has everything the
    # leaving worker sent (a connection's messages arrive in order).
    await report(workers_nc, namespace, DECODE, LoadMetrics(9, active_requests=4))
    await wait_until_async(
        lambda: watcher.load(PoolRole.DECODE).active_requests == 1 + 4,
        timeout=ARRIVAL_TIMEOUT_S,
        what="both workers' reports",
    )
    clock.now += 1.0
    await report(workers_nc, namespace, DECODE, LoadMetrics(9, active_requests=4))
    await arrived(watcher, watcher.stats.reports + 1)

    clock.now += STALE_AFTER_S - 0.5  # past the leaver's last report, not the stayer's
    assert watcher.load(PoolRole.DECODE) == PoolLoad(
        workers=1, active_requests=4, token_weighted_batch=4.0
    )


async def test_malformed_reports_are_counted(
    watcher: WorkerLoadWatcher, workers_nc: NatsClient, namespace: str
) -> None:
    await workers_nc.publish(load_metrics_subject(namespace, DECODE, 1), b"\xc1 not msgpack")
    await workers_nc.publish(load_metrics_subject(namespace, DECODE, 1), encode({"no": "id"}))
    # A report on another worker's subject: not trusted.
    await workers_nc.publish(load_metrics_subject(namespace, DECODE, 2), encode(LoadMetrics(3)))
    await report(workers_nc, namespace, DECODE, LoadMetrics(1, active_requests=1))
    await arrived(watcher, 1)  # arrives after the three malformed ones
    assert watcher.stats.malformed == 3
    assert watcher.load(PoolRole.DECODE) == PoolLoad(
        workers=1, active_requests=1, token_weighted_batch=1.0
    )


def test_k_ties_go_to_the_larger_k() -> None:
    reports = [LoadMetrics(i, num_speculative_tokens=k) for i, k in enumerate([2, 4, 4, 2])]
    assert pool_load(reports).k_in_force == 4
    assert pool_load(list(reversed(reports))).k_in_force == 4
    assert pool_load([LoadMetrics(1)]).k_in_force is None
