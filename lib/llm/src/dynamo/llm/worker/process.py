"""`WorkerProcess`: the life of a worker process around its served workers.

1. SIGTERM/SIGINT handlers, then the system server (when a port is given), so `/health`
   answers 503 while engines load and an orchestrator's probe sees the process at once;
2. the workers start (concurrently, a bounded number at a time); a signal meanwhile
   interrupts the start-up;
3. serving, while a watchdog checks every second that no engine died: an engine that did
   takes the process down with exit code 1 rather than leaving a registered worker that
   fails every request;
4. shutdown: every worker deregisters, drains and stops its engine (in parallel), then
   the system server stops.

Exit codes: 0 after a signal, 1 when a worker failed to start or an engine died, 2 for a
configuration an engine refused (`ConfigError`: one `error:` line, the last on stderr).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from dynamo.llm.worker.served import ServedWorker
from dynamo.runtime.cli import ConfigError
from dynamo.runtime.system_server import HealthCheck, SystemServer

log = logging.getLogger(__name__)

START_CONCURRENCY = 16
"""Workers connecting and registering at the same time (bounds the burst on NATS)."""
WATCH_INTERVAL_S = 1.0

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def workers_health(workers: Sequence[ServedWorker[Any]]) -> HealthCheck:
    """`/health` over every worker of the process: ready when each is. The body says why
    not (`detail`, the first worker's reason) and each worker's state (`workers`, by
    instance id)."""

    def health() -> tuple[bool, dict[str, Any]]:
        states: dict[str, str] = {}
        first_problem = ""
        for index, worker in enumerate(workers):
            healthy, detail = worker.health()
            states[worker.instance_hex or f"#{index}"] = detail
            if not healthy and not first_problem:
                first_problem = detail
        ok = bool(workers) and not first_problem
        return ok, {"detail": "ready" if ok else first_problem or "no workers", "workers": states}

    return health


class WorkerProcess:
    """One process serving `workers`; `await run()` returns its exit code."""

    def __init__(
        self,
        workers: Sequence[ServedWorker[Any]],
        *,
        name: str,
        system_port: int | None = None,
        system_host: str = "0.0.0.0",
        registry: CollectorRegistry | None = None,
    ) -> None:
        if not workers:
            raise ValueError("a worker process needs at least one worker")
        self.workers = list(workers)
        self.name = name
        self.system_port = system_port
        self.system_host = system_host
        self.registry = registry if registry is not None else CollectorRegistry()
        self.system: SystemServer | None = None
        self.exit_code = EXIT_OK
        self._config_error: ConfigError | None = None
        self._stop = asyncio.Event()

    def request_stop(self, exit_code: int = EXIT_OK, reason: str = "") -> None:
        """Begin the shutdown (the first caller's exit code wins)."""
        if not self._stop.is_set():
            log.info("%s stopping%s", self.name, f": {reason}" if reason else "")
            self.exit_code = exit_code
            self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self.request_stop, EXIT_OK, signal.Signals(sig).name)
        watchdog: asyncio.Task[None] | None = None
        try:
            await self._start_system_server()
            if await self._start_workers():
                watchdog = asyncio.create_task(self._watch_engines(), name="engine-watchdog")
                await self._stop.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._shutdown()
        if self._config_error is not None:
            print(f"error: {self._config_error}", file=sys.stderr, flush=True)
        return self.exit_code

    # ------------------------------------------------------------------ steps

    async def _start_system_server(self) -> None:
        if self.system_port is None:  # disabled; 0 picks a free port
            return
        self.system = SystemServer(
            self.system_host, self.system_port, workers_health(self.workers), self.registry
        )
        port = await self.system.start()
        for worker in self.workers:
            worker.system_port = port

    async def _start_workers(self) -> bool:
        """Start every worker; False when a signal came first or a worker failed."""
        gate = asyncio.Semaphore(START_CONCURRENCY)

        async def start_one(worker: ServedWorker[Any]) -> None:
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
        if isinstance(exc, ConfigError):
            self._config_error = exc
            self.request_stop(EXIT_CONFIG, "the engine refused its configuration")
            return False
        if exc is not None:
            log.error("%s: a worker failed to start", self.name, exc_info=exc)
            self.request_stop(EXIT_FAILED, "start-up failed")
            return False
        log.info("%s: %d worker(s) serving", self.name, len(self.workers))
        return True

    async def _watch_engines(self) -> None:
        while not self._stop.is_set():
            for worker in self.workers:
                reason = worker.backend.dead_reason()
                if reason is not None:
                    self.request_stop(EXIT_FAILED, f"{worker.name}: engine dead ({reason})")
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), WATCH_INTERVAL_S)

    async def _shutdown(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        if self.system is not None:
            await self.system.stop()
        log.info("%s stopped (exit code %d)", self.name, self.exit_code)
