"""`--http-workers N`: N frontend processes serving one HTTP port.

One Python process tops out at one core of tokenizing, detokenizing and SSE writing. With
N > 1, `python -m dynamo.frontend` becomes a small supervisor that starts N children,
each a complete frontend (`python -m dynamo.frontend ... --http-workers 1`): its own NATS
connection, model-card watcher, KV router and HTTP server. Every child binds its own
listening socket to the same host:port with SO_REUSEPORT
(`http.listener.share_port_across_processes`), and the kernel spreads new connections
over the N sockets. Nothing is forked from a parent holding an event loop or NATS
connection, so each child starts as clean as a single frontend does.

Across the children:

* KV routing stays consistent: each child's router shares its bookings of requests in
  flight with the others over NATS (`dynamo.llm.kv_router.replica_sync`), as separate
  frontend replicas do.
* `/metrics` answers for the whole frontend from any child: the parent creates a private
  `PROMETHEUS_MULTIPROC_DIR` for prometheus_client's multiprocess mode and removes it
  on exit (`metrics.FrontendMetrics`).
* What stays per process: `--max-inflight-requests` / `--max-waiting-requests` (the
  frontend's admission bounds are N times the flag), and `GET /debug/kv` (one child's
  view, which says which child answered: `http_worker: {index, count}`; a new connection
  may reach another child).

Before starting the children, the supervisor claims the port (`claim_port`): it binds it
once without SO_REUSEPORT, so a port another process already listens on is refused with a
clear error (a second frontend, or a second `--http-workers` group, would otherwise bind
beside it and silently split its traffic), and `--http-port 0` is resolved to one free
port that every child is given (each would otherwise pick a port of its own). Its
metrics directory is named after its pid, and directories left by supervisors that no
longer run (SIGKILLed: no cleanup ran) are removed when the next one starts.

The supervisor: SIGTERM or SIGINT is passed on to every child and waited for (a child
still running after `CHILD_STOP_TIMEOUT_S` is killed); the parent then exits 0. A child
that dies on its own (crashed, killed by the OOM killer) is started again at once, with
an error in the log naming it, its exit and the restart count, while the others go on
serving (the connections it held are lost; clients see a reset); its live gauges are
marked dead in the metrics directory. A child that exits with code 2 (bad
configuration: every child would) or dies `MAX_QUICK_RESTARTS` times in a row within
`STABLE_AFTER_S` of its start makes the parent stop the others and exit 1: a frontend
that cannot keep its children up says so instead of looping. The children are tied to
the parent (`PR_SET_PDEATHSIG`, SIGTERM), so a SIGKILLed parent takes them along.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from dynamo.frontend.http.listener import SHUTDOWN_DRAIN_S, port_sharing_supported
from dynamo.runtime.cli import ConfigError
from dynamo.runtime.parent_death import pid_is_running, preexec_die_with_parent

log = logging.getLogger(__name__)

HTTP_WORKERS_ENV = "DYN_HTTP_WORKERS"
"""Default of `--http-workers` (a test suite can run every frontend with N processes)."""
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's multiprocess directory, read by the library at import."""
WORKER_INDEX_FLAG = "--http-worker-index"
"""Hidden flag the supervisor gives each child: its index, and that it shares the port."""
WORKER_COUNT_FLAG = "--http-worker-count"
"""Hidden flag the supervisor gives each child: how many children share the port."""
CHILD_STOP_TIMEOUT_S = SHUTDOWN_DRAIN_S + 15.0
"""How long a child may drain after SIGTERM before it is killed: longer than a frontend
lets its responses run on (`http.listener.SHUTDOWN_DRAIN_S`), plus time to close, so a
stream is never cut by the supervisor before the child itself would end it."""
POLL_INTERVAL_S = 0.1
FINAL_EXIT_CODE = 2
"""A child exiting with this (argparse's, and the frontend's, "bad configuration") is not
started again: every child would fail the same way."""
STABLE_AFTER_S = 10.0
MAX_QUICK_RESTARTS = 3
"""A child dying this many times in a row, each within `STABLE_AFTER_S` of its start,
ends the frontend."""
METRICS_DIR_PREFIX = "dynamo-frontend-metrics-"
"""Metrics directories are `<tmp>/dynamo-frontend-metrics-<supervisor pid>-<random>`."""


def check_http_workers(count: int) -> None:
    """ConfigError when `count` processes cannot share a port here."""
    if count < 1:
        raise ConfigError(f"--http-workers must be at least 1, got {count}")
    if count > 1 and not port_sharing_supported():
        raise ConfigError(
            "--http-workers above 1 needs SO_REUSEPORT, which this platform lacks; "
            "run one frontend per port behind a load balancer instead"
        )


@dataclass(frozen=True)
class HttpWorkerSlot:
    """Which of a supervisor's `count` children this process is."""

    index: int
    count: int

    def describe(self) -> dict[str, int]:
        """Which child answered: its index, the count, and its pid (a child started
        again keeps its index and has a new pid)."""
        return {"index": self.index, "count": self.count, "pid": os.getpid()}


def child_argv(argv: Sequence[str], index: int, count: int, port: int | None = None) -> list[str]:
    """The command line of child `index` of `count`: the parent's own arguments, one
    worker each, and `port` (the claimed one) where given (the last `--http-port` wins)."""
    return [
        sys.executable,
        "-m",
        "dynamo.frontend",
        *argv,
        *(["--http-port", str(port)] if port is not None else []),
        "--http-workers",
        "1",
        WORKER_INDEX_FLAG,
        str(index),
        WORKER_COUNT_FLAG,
        str(count),
    ]


def claim_port(host: str, port: int) -> int:
    """The port the children will share: `port`, or a free one for 0. ConfigError when
    another process already listens there: bound here without SO_REUSEPORT, the bind
    fails even against listeners that share the port among themselves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"--http-port {port} on {host}: {exc.strerror or exc}; another process "
                "listens there (its traffic and this frontend's would be split between them)"
            ) from None
        return int(probe.getsockname()[1])


def remove_stale_metrics_dirs(root: Path | None = None) -> list[Path]:
    """Remove the metrics directories of supervisors that no longer run (a SIGKILLed one
    could not); returns what was removed. Only this user's plain directories are touched."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for path in root.glob(f"{METRICS_DIR_PREFIX}*"):
        pid_text = path.name[len(METRICS_DIR_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or path.is_symlink() or not path.is_dir():
            continue
        if path.stat().st_uid != os.getuid() or pid_is_running(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def metrics_dir_of_child() -> Path | None:
    """In a child, the shared metrics directory its parent made (None outside one)."""
    value = os.environ.get(METRICS_DIR_ENV)
    return Path(value) if value else None


@dataclass
class ChildProcess:
    """One HTTP worker process the supervisor keeps running, and its restart history."""

    index: int
    popen: subprocess.Popen[bytes]
    started_at: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0  # in a row, each within STABLE_AFTER_S of its start


class HttpWorkers:
    """Starts and supervises the N children (see the module)."""

    def __init__(self, count: int, argv: Sequence[str], port: int | None = None) -> None:
        """`port`: the one `claim_port` returned, given to every child."""
        check_http_workers(count)
        self.count = count
        self.argv = list(argv)
        self.port = port
        self.children: list[ChildProcess] = []
        self._signal: int | None = None
        self._metrics_dir: Path | None = None

    def run(self) -> int:
        """Start the children and supervise them; the parent's exit status."""
        for stale in remove_stale_metrics_dirs():
            log.info("frontend: removed %s, left by a supervisor that no longer runs", stale)
        metrics_dir = Path(tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-"))
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        self._metrics_dir = metrics_dir
        try:
            self._start()
            return self._supervise()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, METRICS_DIR_ENV: str(self._metrics_dir), HTTP_WORKERS_ENV: "1"}
        return subprocess.Popen(
            child_argv(self.argv, index, self.count, self.port),
            env=env,
            preexec_fn=preexec_die_with_parent(signal.SIGTERM),
        )

    def _start(self) -> None:
        for index in range(self.count):
            if self._signal is not None:
                return
            self.children.append(ChildProcess(index, self._spawn(index), time.monotonic()))
        log.info(
            "frontend: %d http worker processes (pids %s) sharing one port",
            self.count,
            ", ".join(str(child.popen.pid) for child in self.children),
        )

    def _supervise(self) -> int:
        while True:
            if self._signal is not None:
                log.info(
                    "frontend: %s, stopping %d http workers",
                    signal.Signals(self._signal).name,
                    len(self.children),
                )
                return 0
            for child in self.children:
                code = child.popen.poll()
                if code is not None and not self.restart(child, code):
                    return 1
            time.sleep(POLL_INTERVAL_S)

    def restart(self, child: ChildProcess, code: int) -> bool:
        """Start a child that died again; False when it must not be (see the module)."""
        now = time.monotonic()
        child.quick_deaths = (
            child.quick_deaths + 1 if now - child.started_at < STABLE_AFTER_S else 0
        )
        if code == FINAL_EXIT_CODE or child.quick_deaths >= MAX_QUICK_RESTARTS:
            why = (
                "bad configuration"
                if code == FINAL_EXIT_CODE
                else (f"it died {child.quick_deaths} times in a row within {STABLE_AFTER_S:g}s")
            )
            log.error(
                "frontend: http worker %d (pid %d) exited with %s (%s); stopping the other "
                "%d and exiting",
                child.index, child.popen.pid, _describe_exit(code), why, len(self.children) - 1,
            )  # fmt: skip
            return False
        self._mark_dead(child.popen.pid)
        child.restarts += 1
        log.error(
            "frontend: http worker %d (pid %d) exited with %s; starting it again (restart %d); "
            "the connections it held are lost",
            child.index, child.popen.pid, _describe_exit(code), child.restarts,
        )  # fmt: skip
        child.popen = self._spawn(child.index)
        child.started_at = now
        return True

    def _mark_dead(self, pid: int) -> None:
        """Drop a dead child's live gauges from the shared metrics (its counters stay)."""
        if self._metrics_dir is None:
            return
        from prometheus_client import multiprocess

        try:
            multiprocess.mark_process_dead(pid, str(self._metrics_dir))
        except OSError as exc:
            log.warning("frontend: could not mark http worker pid %d dead in metrics: %s", pid, exc)

    def _stop_all(self) -> None:
        """SIGTERM to every child still running, then wait; kill the stragglers."""
        running = [child for child in self.children if child.popen.poll() is None]
        for child in running:
            child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
        for child in running:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "frontend: http worker %d (pid %d) still running after %.0fs; killing it",
                    child.index,
                    child.popen.pid,
                    CHILD_STOP_TIMEOUT_S,
                )
                child.popen.kill()
                child.popen.wait()


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"
