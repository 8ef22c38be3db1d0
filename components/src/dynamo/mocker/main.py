"""`python -m dynamo.mocker`: N simulated workers in one process.

Process lifecycle, as the vLLM worker's: optional system server first (so `/health`
answers 503 while starting), then the workers (concurrently; each connects, serves and
registers on its own), then wait for SIGTERM/SIGINT, then every worker deregisters and
drains in parallel. Exit codes: 0 after a signal, 1 when a worker could not start or an
engine died, 2 for bad configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo.mocker.args import (
    ConfigError,
    MockerArgs,
    parse_args,
    resolve_model_dir,
    served_model_name,
)
from dynamo.mocker.config import MockEngineConfig
from dynamo.mocker.model_info import ModelInfo

if TYPE_CHECKING:  # the NATS-side modules load only once a process is built
    from dynamo.mocker.worker import MockerWorker
    from dynamo.runtime.system_server import SystemServer

log = logging.getLogger("dynamo.mocker")

START_CONCURRENCY = 16
"""Workers connecting and registering at the same time (bounds the burst on NATS)."""
WATCH_INTERVAL_S = 1.0


class MockerProcess:
    """The workers of one `python -m dynamo.mocker` process and their shared lifecycle."""

    def __init__(
        self,
        args: MockerArgs,
        engine_config: MockEngineConfig,
        model_dir: Path,
        served_name: str,
    ) -> None:
        from dynamo.mocker.worker import MockerWorker

        self.args = args
        self.workers = [
            MockerWorker(
                args.worker,
                engine_config,
                model_path=model_dir,
                served_model_name=served_name,
                name=f"mocker-{index}",
            )
            for index in range(args.num_workers)
        ]
        self.served_name = served_name
        self.system: SystemServer | None = None
        self.exit_code = 0
        self._stop = asyncio.Event()

    def request_stop(self, exit_code: int = 0, reason: str = "") -> None:
        if not self._stop.is_set():
            log.info("stopping%s", f": {reason}" if reason else "")
            self.exit_code = exit_code
            self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self.request_stop, 0, signal.Signals(sig).name)
        watchdog: asyncio.Task[None] | None = None
        try:
            await self._start_system_server()
            if await self._start_workers():
                log.info("%d mocker workers serving %s", len(self.workers), self.served_name)
                watchdog = asyncio.create_task(self._watch_engines(), name="engine-watchdog")
                await self._stop.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._shutdown()
        return self.exit_code

    async def _start_system_server(self) -> None:
        if self.args.system_port is None:
            return
        from dynamo.mocker.system_server import mocker_system_server

        self.system = mocker_system_server(
            "0.0.0.0", self.args.system_port, self.workers, self.served_name
        )
        port = await self.system.start()
        for worker in self.workers:
            worker.system_port = port

    async def _start_workers(self) -> bool:
        """Start every worker; False when stopped first or a worker failed to start."""
        gate = asyncio.Semaphore(START_CONCURRENCY)

        async def start_one(worker: MockerWorker) -> None:
            async with gate:
                await worker.start()

        starting = asyncio.ensure_future(asyncio.gather(*(start_one(w) for w in self.workers)))
        stopper = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
            return False
        exc = starting.exception()
        if exc is not None:
            log.error("a worker failed to start: %s", exc)
            self.request_stop(1, "start-up failed")
            return False
        return True

    async def _watch_engines(self) -> None:
        """An engine that died (a bug) takes the process down with exit code 1 rather
        than leaving a registered worker that fails every request."""
        while not self._stop.is_set():
            for worker in self.workers:
                if worker.engine.dead is not None:
                    self.request_stop(1, f"{worker.name}: engine dead ({worker.engine.dead})")
                    return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), WATCH_INTERVAL_S)

    async def _shutdown(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        if self.system is not None:
            await self.system.stop()
        log.info("mocker stopped (exit code %d)", self.exit_code)


def build_process(args: MockerArgs) -> MockerProcess:
    """Resolve the model and the engine configuration (ConfigError when unusable)."""
    try:
        model_dir = resolve_model_dir(args.model)
        model = ModelInfo.load(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {args.model}: {exc}") from exc
    engine_config = args.engine.engine_config(model)
    return MockerProcess(args, engine_config, model_dir, served_model_name(args))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )

    async def run() -> int:
        try:
            process = build_process(args)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return await process.run()

    try:
        import uvloop

        return uvloop.run(run())
    except ImportError:
        return asyncio.run(run())
