"""`python -m dynamo.planner`: see `dynamo.planner` and docs/planner.md."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from dynamo.planner.args import PlannerConfig, parse_args
from dynamo.planner.connectors import ConnectorError
from dynamo.planner.service import run_planner
from dynamo.runtime.cli import ConfigError, configure_logging

log = logging.getLogger("dynamo.planner")


async def _serve(config: PlannerConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.info(
        "planning %s (%s) for TTFT p90 <= %.0f ms, ITL p90 <= %.0f ms every %g s, connector %s",
        config.served_model_name,
        config.topology,
        config.targets.ttft_s * 1000,
        config.targets.itl_s * 1000,
        config.loop.interval_s,
        config.connector,
    )
    await run_planner(config, stop)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    try:
        return asyncio.run(_serve(config))
    except ConnectorError as exc:  # a Deployment or a permission missing: say what to fix
        log.error("the %s connector failed: %s", config.connector, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
