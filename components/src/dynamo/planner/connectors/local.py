"""The `local` connector: each pool's workers as processes on this machine.

A worker is `python -m dynamo.mocker` or `python -m dynamo.vllm` (`WorkerLauncher` builds
its command line), started as a child of the planner with its output in
`<log_dir>/<pool>-<index>.log`. What a planner needs from the processes, and how this
module gives it:

* scaling up does not wait for a worker to serve (a vLLM engine loads for a minute): the
  planner sees the new capacity in the workers' load reports once they register;
* scaling down stops the newest workers first (the oldest have the warmest prefix caches)
  with SIGTERM, which drains them (docs/architecture.md, Processes); a stopping worker no
  longer counts at once, so the planner never waits on a drain, and a background task
  SIGKILLs it when it outlives `--drain-timeout` by a margin;
* a worker that exits on its own is logged with its exit code and log and no longer
  counted, so the planner's next `scale()` starts a replacement;
* each worker runs in a session of its own, so a Ctrl-C on the planner's terminal does not
  reach the workers before the planner drains them, and through `python -m
  dynamo.runtime.parent_death`, so it gets SIGTERM (and drains) when the planner dies,
  even by SIGKILL. The kernel ties a child to the *thread* that started it: run the
  connector on the main thread's event loop (`asyncio.run`), as the planner does.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.llm.worker import DEFAULT_DRAIN_TIMEOUT_S
from dynamo.planner.pools import PoolRole
from dynamo.runtime.nats_address import ENV_NATS_SERVER
from dynamo.runtime.nats_options import url_has_credentials

log = logging.getLogger(__name__)

KILL_MARGIN_S = 15.0
"""How long past its drain timeout a stopping worker may take to exit (stop its engine,
deregister) before it is killed."""


class WorkerKind(enum.StrEnum):
    """The worker program a pool runs (the planner's `--worker-kind`)."""

    MOCKER = "mocker"
    VLLM = "vllm"

    @property
    def module(self) -> str:
        return f"dynamo.{self.value}"


@dataclass(frozen=True)
class WorkerLauncher:
    """How to start one worker of one pool: the command line every worker of the pool
    shares. `extra_args` go last, verbatim (mocker timing flags, vLLM engine flags), so they
    can override what is set here. `component` None keeps the worker's own default
    (`backend`, or `prefill` for prefill workers), which is what the planner listens to."""

    kind: WorkerKind
    model: str
    namespace: str
    nats_server: str
    role: PoolRole
    served_model_name: str | None = None
    component: str | None = None
    extra_args: tuple[str, ...] = ()

    def argv(self, drain_timeout_s: float) -> list[str]:
        """The worker's command line. The NATS URL is left out when it carries credentials
        (a command line is visible to every user of the machine): `environment()` then
        hands it over as `$NATS_SERVER`, which the workers read as a default."""
        argv = [sys.executable, "-m", self.kind.module, "--model", self.model]
        argv += ["--namespace", self.namespace]
        if not url_has_credentials(self.nats_server):
            argv += ["--nats-server", self.nats_server]
        if self.kind is WorkerKind.MOCKER:
            argv += ["--num-workers", "1"]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.component:
            argv += ["--component", self.component]
        argv += self._role_flags()
        argv += ["--drain-timeout", f"{drain_timeout_s:g}", *self.extra_args]
        return argv

    def environment(self) -> dict[str, str]:
        """Variables the worker needs on top of the planner's own environment."""
        if url_has_credentials(self.nats_server):
            return {ENV_NATS_SERVER: self.nats_server}
        return {}

    def _role_flags(self) -> list[str]:
        """The role flags each program documents (`launch/disagg.sh` for vLLM)."""
        if self.role is PoolRole.AGGREGATED:
            return []
        if self.kind is WorkerKind.MOCKER:
            return ["--disaggregation-mode", self.role.value]
        return [f"--is-{self.role.value}-worker"]


@dataclass(frozen=True)
class WorkerInfo:
    """One started worker, as logs and callers name it."""

    role: PoolRole
    index: int  # per pool, from 0, never reused: `<log_dir>/<role>-<index>.log`
    pid: int
    log_path: Path

    def __str__(self) -> str:
        return f"worker {self.index} (pid {self.pid})"


@dataclass(frozen=True)
class WorkerExit:
    """A worker's end, handed to `LocalConnector`'s `on_exit` (e.g. to count crashes)."""

    worker: WorkerInfo
    exit_code: int  # negative: killed by that signal
    asked_to_stop: bool  # False: it exited on its own (a crash, an engine that died)


@dataclass(eq=False)
class _Worker:
    """One started process. `stopping`: told to stop, no longer counted."""

    info: WorkerInfo
    process: asyncio.subprocess.Process
    stopping: bool = False
    exited: asyncio.Task[int] | None = field(default=None, repr=False)

    @property
    def counted(self) -> bool:
        return not self.stopping and self.process.returncode is None


class LocalConnector:
    """`Connector` over worker processes on this machine (see the module).

    `launchers`: one per pool this connector runs (a pool's role is its launcher's
    `role`). `start()` only prepares `log_dir`: the planner's first `scale()` starts the
    first workers. `on_exit` hears of every worker's end, asked for or not. `close()`
    drains and stops every worker; it is idempotent."""

    def __init__(
        self,
        launchers: Iterable[WorkerLauncher],
        log_dir: Path,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        *,
        kill_margin_s: float = KILL_MARGIN_S,
        on_exit: Callable[[WorkerExit], None] | None = None,
    ) -> None:
        self._launchers: dict[PoolRole, WorkerLauncher] = {}
        for launcher in launchers:
            if launcher.role in self._launchers:
                raise ValueError(f"two launchers for the {launcher.role} pool")
            self._launchers[launcher.role] = launcher
        if drain_timeout_s < 0 or kill_margin_s < 0:
            raise ValueError("drain_timeout_s and kill_margin_s must be >= 0")
        self.log_dir = log_dir
        self.drain_timeout_s = drain_timeout_s
        self.kill_margin_s = kill_margin_s
        self._on_exit = on_exit
        self._workers: dict[PoolRole, list[_Worker]] = {role: [] for role in self._launchers}
        self._indexes = {role: itertools.count() for role in self._launchers}
        self._stops: dict[_Worker, asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)

    async def replicas(self, role: PoolRole) -> int:
        return len(self._counted(role))

    def workers(self, role: PoolRole) -> list[WorkerInfo]:
        """The workers `replicas()` counts, oldest first."""
        return [w.info for w in self._counted(role)]

    async def scale(self, role: PoolRole, replicas: int) -> None:
        """Start workers, or stop the newest, until `replicas` are counted; returns once
        each process is started or signalled."""
        if replicas < 0:
            raise ValueError(f"{role}: replicas must be >= 0, not {replicas}")
        async with self._lock:
            if self._closed:
                raise RuntimeError("the local connector is closed")
            counted = self._counted(role)
            for _ in range(replicas - len(counted)):
                await self._start_worker(role)
            for worker in reversed(counted[replicas:]):
                self._stop_worker(worker)

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            for workers in self._workers.values():
                for worker in workers:
                    if not worker.stopping:
                        self._stop_worker(worker)
        stops = list(self._stops.values())
        watchers = [w.exited for ws in self._workers.values() for w in ws if w.exited]
        await asyncio.gather(*stops, *watchers, return_exceptions=True)

    # ------------------------------------------------------------------ workers

    def _counted(self, role: PoolRole) -> list[_Worker]:
        """The pool's running, not stopping workers, oldest first."""
        if role not in self._launchers:
            raise ValueError(f"no launcher for the {role} pool (have: {list(self._launchers)})")
        return [w for w in self._workers[role] if w.counted]

    async def _start_worker(self, role: PoolRole) -> None:
        launcher = self._launchers[role]
        index = next(self._indexes[role])
        log_path = self.log_dir / f"{role.value}-{index}.log"
        # The wrapper execs the worker in the same process: the pid is the worker's.
        argv = [
            sys.executable, "-m", "dynamo.runtime.parent_death",
            "--parent-pid", str(os.getpid()), "--",
            *launcher.argv(self.drain_timeout_s),
        ]  # fmt: skip
        with log_path.open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **launcher.environment()},
                start_new_session=True,
            )
        worker = _Worker(WorkerInfo(role, index, process.pid, log_path), process)
        worker.exited = asyncio.create_task(self._watch(worker), name=f"{role}-{index} exit")
        self._workers[role].append(worker)
        log.info("%s: started %s, log %s", role, worker.info, log_path)

    async def _watch(self, worker: _Worker) -> int:
        """Waits for the process to exit, whoever ended it; reports a crash."""
        info = worker.info
        code = await worker.process.wait()
        self._workers[info.role].remove(worker)
        _kill_group(info.pid)  # what the worker started and left behind (engine cores)
        if not worker.stopping:
            log.warning(
                "%s: %s exited on its own (%s); log %s",
                info.role, info, _describe_exit(code), info.log_path,
            )  # fmt: skip
        if self._on_exit is not None:
            try:
                self._on_exit(WorkerExit(info, code, asked_to_stop=worker.stopping))
            except Exception:  # a listener's bug must not stop the reaping
                log.exception("%s: on_exit failed for %s", info.role, info)
        return code

    def _stop_worker(self, worker: _Worker) -> None:
        """SIGTERM now; the drain and a late kill happen in the background."""
        worker.stopping = True
        log.info(
            "%s: stopping %s, draining up to %g s",
            worker.info.role, worker.info, self.drain_timeout_s,
        )  # fmt: skip
        try:
            worker.process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass  # it exited already; its watcher reaps it
        task = asyncio.create_task(self._finish_stop(worker), name=f"stop {worker.info}")
        self._stops[worker] = task
        task.add_done_callback(lambda _: self._stops.pop(worker, None))

    async def _finish_stop(self, worker: _Worker) -> None:
        """Waits for a stopping worker, and kills it when it outlives its drain."""
        assert worker.exited is not None
        info, deadline = worker.info, self.drain_timeout_s + self.kill_margin_s
        started = time.monotonic()
        try:
            code = await asyncio.wait_for(asyncio.shield(worker.exited), deadline)
        except TimeoutError:
            log.warning(
                "%s: %s still running %g s after SIGTERM; killing it (log %s)",
                info.role, info, deadline, info.log_path,
            )  # fmt: skip
            _kill_group(info.pid)
            code = await worker.exited
        log.info(
            "%s: %s stopped after %.1f s (%s)",
            info.role, info, time.monotonic() - started, _describe_exit(code),
        )  # fmt: skip


def _kill_group(pgid: int) -> None:
    """SIGKILL to a worker's process group (its own session); nothing if it is gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
