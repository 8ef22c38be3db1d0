"""`python -m dynamo.mocker`: N simulated workers in one process.

The command line becomes `MockerArgs` (`args`); each worker is a `MockerBackend` served by
`dynamo.llm.worker` — the process life cycle (system server first, workers started
concurrently, SIGTERM drain in parallel, exit codes 0 / 1 / 2) is the vLLM worker's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvloop
from prometheus_client import CollectorRegistry

from dynamo.llm.worker import WorkerProcess
from dynamo.mocker.args import (
    ConfigError,
    MockerArgs,
    parse_args,
    resolve_model_dir,
    served_model_name,
)
from dynamo.mocker.backend import mocker_worker
from dynamo.mocker.metrics import MockerCollector
from dynamo.mocker.model_info import ModelInfo
from dynamo.runtime.cli import configure_logging
from dynamo.runtime.gc_tuning import tune_for_serving


def build_process(args: MockerArgs) -> WorkerProcess:
    """Resolve the model and the engine configuration (ConfigError when unusable) and
    assemble the workers; nothing connects until `run()`."""
    try:
        model_dir = resolve_model_dir(args.model)
        model = ModelInfo.load(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {args.model}: {exc}") from exc
    engine_config = args.engine.engine_config(model)
    served = served_model_name(args)
    workers = [
        mocker_worker(
            args.worker,
            engine_config,
            model_path=model_dir,
            served_model_name=served,
            name=f"mocker-{index}",
        )
        for index in range(args.num_workers)
    ]
    # A private registry keeps several mocker processes' worth of series in one test
    # process from colliding.
    registry = CollectorRegistry()
    registry.register(MockerCollector(workers, served))
    return WorkerProcess(workers, name="mocker", system_port=args.system_port, registry=registry)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)

    async def run() -> int:
        try:
            process = build_process(args)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return await process.run()

    tune_for_serving()
    return uvloop.run(run())
