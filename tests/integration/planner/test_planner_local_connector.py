"""The planner's `local` connector over real mocker processes and a real nats-server.

Claims: each (worker kind, pool) gets the command line its program documents, and the
mocker's own parser reads it as that pool's role; scaling up starts workers that
register; scaling down counts the stopped worker as gone at once, stops the newest one
(SIGTERM, a drain, exit 0) and leaves the oldest running; a worker that exits on its own is
no longer counted and is reported as such; `close()` stops every worker, and twice is
harmless.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from dynamo.mocker.args import parse_args as parse_mocker_args
from dynamo.planner.connectors.local import (
    LocalConnector,
    WorkerExit,
    WorkerKind,
    WorkerLauncher,
)
from dynamo.planner.pools import PoolRole
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.parent_death import pid_is_running
from dynamo.testing.waiting import wait_until_async

pytestmark = pytest.mark.integration

SERVED = "planner-local-mock"
URL = "nats://127.0.0.1:4999"
START_TIMEOUT_S = 60.0  # hang guard: a mocker starts in ~2 s on an idle machine


def mocker(
    role: PoolRole, nats_url: str, namespace: str, *extra: str, model: str = "smollm2-135m-instruct"
) -> WorkerLauncher:
    return WorkerLauncher(
        WorkerKind.MOCKER,
        model,
        namespace,
        nats_url,
        role,
        served_model_name=SERVED,
        extra_args=extra,
    )


ROLE_FLAGS = {
    (WorkerKind.MOCKER, PoolRole.AGGREGATED): [],
    (WorkerKind.MOCKER, PoolRole.PREFILL): ["--disaggregation-mode", "prefill"],
    (WorkerKind.MOCKER, PoolRole.DECODE): ["--disaggregation-mode", "decode"],
    (WorkerKind.VLLM, PoolRole.AGGREGATED): [],
    (WorkerKind.VLLM, PoolRole.PREFILL): ["--is-prefill-worker"],
    (WorkerKind.VLLM, PoolRole.DECODE): ["--is-decode-worker"],
}


@pytest.mark.parametrize(("kind", "role"), list(ROLE_FLAGS))
def test_each_kind_and_pool_gets_its_command_line(kind: WorkerKind, role: PoolRole) -> None:
    launcher = WorkerLauncher(
        kind, "/models/m", "ns1", URL, role, served_model_name="m", extra_args=("--seed", "3")
    )
    own = ["--num-workers", "1"] if kind is WorkerKind.MOCKER else []
    assert launcher.argv(7.5) == [
        sys.executable, "-m", f"dynamo.{kind}",
        "--model", "/models/m", "--namespace", "ns1", "--nats-server", URL,
        *own, "--served-model-name", "m", *ROLE_FLAGS[kind, role],
        "--drain-timeout", "7.5", "--seed", "3",
    ]  # fmt: skip
    assert launcher.environment() == {}


@pytest.mark.parametrize("role", list(PoolRole))
def test_the_mocker_reads_the_command_line_as_the_pools_role(role: PoolRole) -> None:
    argv = mocker(role, URL, "ns1", "--speed-up", "4").argv(12.0)
    parsed = parse_mocker_args(argv[3:])
    mode = {PoolRole.AGGREGATED: "agg"}.get(role, role.value)
    assert parsed.worker.disaggregation_mode == mode
    assert parsed.worker.component == ("prefill" if role is PoolRole.PREFILL else "backend")
    assert (parsed.num_workers, parsed.worker.drain_timeout) == (1, 12.0)
    assert (parsed.worker.namespace, parsed.worker.served_model_name) == ("ns1", SERVED)
    assert parsed.engine.timing.speed_up == 4.0


def test_a_nats_url_with_credentials_goes_through_the_environment() -> None:
    url = "nats://planner:s3cret@127.0.0.1:4222"
    launcher = mocker(PoolRole.DECODE, url, "ns1")
    assert not [arg for arg in launcher.argv(1.0) if "s3cret" in arg]
    assert launcher.environment() == {"NATS_SERVER": url}


def test_launchers_must_name_distinct_pools(tmp_path: Path) -> None:
    twice = [mocker(PoolRole.DECODE, URL, "ns1"), mocker(PoolRole.DECODE, URL, "ns1")]
    with pytest.raises(ValueError, match="two launchers"):
        LocalConnector(twice, tmp_path)


async def test_a_worker_that_exits_on_its_own_is_no_longer_counted(tmp_path: Path) -> None:
    exits: list[WorkerExit] = []
    launcher = mocker(PoolRole.AGGREGATED, URL, "ns1", "--no-such-flag")
    connector = LocalConnector([launcher], tmp_path / "logs", 1.0, on_exit=exits.append)
    await connector.start()
    try:
        await connector.scale(PoolRole.AGGREGATED, 1)
        await wait_until_async(lambda: exits, timeout=START_TIMEOUT_S, what="the mocker to exit")
        assert await connector.replicas(PoolRole.AGGREGATED) == 0
        [crash] = exits
        assert (crash.exit_code, crash.asked_to_stop) == (2, False)  # argparse's exit code
        assert crash.worker.log_path == tmp_path / "logs" / "aggregated-0.log"
        assert "--no-such-flag" in crash.worker.log_path.read_text()
    finally:
        await connector.close()


async def test_scaling_down_drains_the_newest_worker_and_keeps_the_oldest(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    namespace = "plocal" + uuid.uuid4().hex[:8]
    exits: list[WorkerExit] = []
    # A long lease: a busy host can miss heartbeats, and nothing here waits for one to expire.
    launcher = mocker(
        PoolRole.DECODE, nats_url, namespace, "--lease-ttl", "10", model=str(embedded_model)
    )
    connector = LocalConnector([launcher], tmp_path / "logs", 5.0, on_exit=exits.append)
    await connector.start()
    runtime = await DistributedRuntime.connect(nats_url)
    client = await runtime.namespace(namespace).component("backend").endpoint("generate").client()
    try:
        await connector.scale(PoolRole.DECODE, 2)
        assert await connector.replicas(PoolRole.DECODE) == 2
        oldest, newest = connector.workers(PoolRole.DECODE)

        def both_registered() -> bool:
            assert not exits, f"a worker exited: {exits}"
            return len(client.instance_ids()) == 2

        await wait_until_async(
            both_registered, timeout=START_TIMEOUT_S, what="two decode workers", interval=0.1
        )

        await connector.scale(PoolRole.DECODE, 1)
        assert await connector.replicas(PoolRole.DECODE) == 1
        assert connector.workers(PoolRole.DECODE) == [oldest]
        await wait_until_async(lambda: exits, timeout=30, what="the newest worker to exit")
        assert exits == [WorkerExit(newest, 0, asked_to_stop=True)], newest.log_path.read_text()
        await wait_until_async(
            lambda: len(client.instances()) == 1, timeout=10, what="one registered instance"
        )
        assert pid_is_running(oldest.pid)
        assert len(client.instance_ids()) == 1
    finally:
        await connector.close()
        await connector.close()  # idempotent
        await client.close()
        await runtime.shutdown(drain_timeout=0)
    assert exits[1:] == [WorkerExit(oldest, 0, asked_to_stop=True)]
    assert await connector.replicas(PoolRole.DECODE) == 0
    with pytest.raises(RuntimeError, match="closed"):
        await connector.scale(PoolRole.DECODE, 1)
