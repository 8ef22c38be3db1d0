"""What the planner's loop does when its connector fails.

Claims: a transient failure (an API server not reached, a 5xx) costs one interval, logged,
and the planner carries on; any other (a Deployment or a permission missing) stops the
planner with the connector's message, which says what to fix, instead of a loop that
retries what cannot work."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from aiohttp import web

from dynamo.planner.args import parse_args
from dynamo.planner.connectors import ConnectorError
from dynamo.planner.pools import PoolRole
from dynamo.planner.service import run_planner

pytestmark = pytest.mark.integration

GUARD_S = 30.0


class Failure(ConnectorError):
    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self._transient = transient

    @property
    def transient(self) -> bool:
        return self._transient


class FailingConnector:
    """Serves one worker; `replicas()` then fails as `failures` says, one per interval."""

    def __init__(self, failures: list[Failure]) -> None:
        self.failures = failures
        self.calls = 0
        self.closed = False

    async def start(self) -> None:
        pass

    async def replicas(self, role: PoolRole) -> int:
        self.calls += 1
        if self.calls > 1 and self.failures:  # the first call is the start-up check
            raise self.failures.pop(0)
        return 1

    async def scale(self, role: PoolRole, replicas: int) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


def profile(path: Path) -> Path:
    step = [30.0, 31.0, 33.0]
    path.write_text(json.dumps({
        "model": "m", "method": "none", "speculative_config": {}, "batch_sizes": [1, 2, 4],
        "acceptance_per_position": [], "step_times": [{"k": 0, "step_ms": step}],
        "no_speculation_step_ms": step, "schedule": [[1, 4, 0]], "max_batch_size": 4,
    }))  # fmt: skip
    return path


async def test_a_transient_failure_skips_an_interval_and_a_lasting_one_stops_the_planner(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text="")  # a frontend that has served nothing yet

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    config = parse_args([
        "--ttft-ms", "1000", "--itl-ms", "100", "--profile", str(profile(tmp_path / "p.json")),
        "--nats-server", nats_url, "--interval", "0.2", "--frontend-url", f"http://{host}:{port}",
    ])  # fmt: skip
    connector = FailingConnector(
        [Failure("API server not reached", True), Failure("RBAC: may not patch", False)]
    )
    caplog.set_level(logging.WARNING, logger="dynamo.planner.service")
    try:
        with pytest.raises(Failure, match="RBAC"):
            await asyncio.wait_for(run_planner(config, asyncio.Event(), connector), GUARD_S)
    finally:
        await runner.cleanup()
    assert "interval skipped, the connector failed (will retry): API server not reached" in (
        caplog.text
    )
    assert connector.calls == 3 and connector.closed
