"""`--http-workers` and `--router-replica-sync` on the command line.

Claims: one process and replica sync on are the defaults, `$DYN_HTTP_WORKERS` and
`$DYN_ROUTER_REPLICA_SYNC` change them; fewer than one worker is refused by the parser;
where the platform lacks SO_REUSEPORT, `--http-workers 2` is refused with an `error:` line
and exit status 2 before anything starts; a child's command line is the parent's with one
worker and its index, and a child shares its port and reads the metrics directory its
parent made. (The processes themselves: tests/integration/frontend/test_http_workers.py.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamo.frontend.__main__ import build_parser, config_from_args, main
from dynamo.frontend.http import workers as http_workers
from dynamo.frontend.http.listener import SHUTDOWN_DRAIN_S
from dynamo.frontend.http.workers import (
    FINAL_EXIT_CODE,
    MAX_QUICK_RESTARTS,
    METRICS_DIR_PREFIX,
    WORKER_COUNT_FLAG,
    WORKER_INDEX_FLAG,
    ChildProcess,
    HttpWorkers,
    HttpWorkerSlot,
    check_http_workers,
    child_argv,
    claim_port,
    remove_stale_metrics_dirs,
)
from dynamo.runtime.cli import ConfigError


def test_one_process_and_replica_sync_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_HTTP_WORKERS", raising=False)
    monkeypatch.delenv("DYN_ROUTER_REPLICA_SYNC", raising=False)
    args = build_parser().parse_args([])
    config = config_from_args(args)
    assert args.http_workers == 1 and args.http_worker_index is None
    assert config.router.replica_sync is True
    assert (config.shared_port, config.metrics_dir) == (False, None)


def test_the_environment_sets_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HTTP_WORKERS", "3")
    monkeypatch.setenv("DYN_ROUTER_REPLICA_SYNC", "0")
    args = build_parser().parse_args([])
    assert args.http_workers == 3
    assert config_from_args(args).router.replica_sync is False
    args = build_parser().parse_args(["--http-workers", "1", "--router-replica-sync"])
    assert args.http_workers == 1 and config_from_args(args).router.replica_sync is True


def test_replica_sync_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_ROUTER_REPLICA_SYNC", raising=False)
    args = build_parser().parse_args(["--no-router-replica-sync"])
    assert config_from_args(args).router.replica_sync is False


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_fewer_than_one_worker_is_refused(value: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--http-workers", value])
    with pytest.raises(ConfigError):
        check_http_workers(0)


def test_without_so_reuseport_several_workers_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(http_workers, "port_sharing_supported", lambda: False)
    check_http_workers(1)  # one process needs no port sharing
    assert main(["--http-workers", "2", "--nats-server", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --http-workers above 1 needs SO_REUSEPORT"), err


def test_a_child_is_the_parent_with_one_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = child_argv(["--http-port", "9000", "--http-workers", "2"], 1, 2)
    assert argv[1:] == [
        "-m",
        "dynamo.frontend",
        "--http-port",
        "9000",
        "--http-workers",
        "2",
        "--http-workers",
        "1",
        WORKER_INDEX_FLAG,
        "1",
        WORKER_COUNT_FLAG,
        "2",
    ]
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    args = build_parser().parse_args(argv[3:])
    config = config_from_args(args)
    assert (args.http_workers, args.http_worker_index) == (1, 1)
    assert (config.shared_port, config.metrics_dir) == (True, tmp_path)
    assert config.http_worker == HttpWorkerSlot(index=1, count=2)


# ---------------------------------------------------------------------- the port and leftovers


def listener(port: int = 0, *, reuse_port: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "shared"])
def test_a_port_another_process_listens_on_is_refused(
    capsys: pytest.CaptureFixture[str], reuse_port: bool
) -> None:
    """Without the check, children binding with SO_REUSEPORT would join a listener that
    shares its port (another `--http-workers` frontend) and split its traffic."""
    with listener(reuse_port=reuse_port) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="another process listens there"):
            claim_port("127.0.0.1", port)
        argv = ["--http-workers", "2", "--http-host", "127.0.0.1", "--http-port", str(port)]
        assert main([*argv, "--nats-server", "nats://127.0.0.1:1"]) == 2
        assert "another process listens there" in capsys.readouterr().err


def test_port_zero_becomes_one_port_that_every_child_gets() -> None:
    port = claim_port("127.0.0.1", 0)
    assert port > 0
    with listener(port):  # it was free, and is released again for the children
        pass
    argv = child_argv(["--http-port", "0"], 0, 2, port)
    args = build_parser().parse_args(argv[3:])
    assert args.http_port == port


def test_metrics_dirs_of_supervisors_that_no_longer_run_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{METRICS_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{METRICS_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{METRICS_DIR_PREFIX}notapid"
    for path in (stale, live, other):
        path.mkdir()
        (path / "counter_1.db").write_bytes(b"x")
    assert remove_stale_metrics_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def test_children_get_longer_to_stop_than_they_let_responses_run() -> None:
    """The supervisor kills a child only after the child's own drain bound (it used to
    kill at 30 s while a child let streams run 60 s, cutting them without an error)."""
    assert http_workers.CHILD_STOP_TIMEOUT_S > SHUTDOWN_DRAIN_S


# ---------------------------------------------------------------------- dead children


class Spawned:
    """Stands in for a child process: `HttpWorkers` only reads its pid here."""

    def __init__(self, pid: int) -> None:
        self.pid = pid


def supervisor(monkeypatch: pytest.MonkeyPatch) -> tuple[HttpWorkers, list[int]]:
    workers = HttpWorkers(2, ["--http-port", "9000"])
    spawned: list[int] = []

    def spawn(index: int) -> Spawned:
        spawned.append(index)
        return Spawned(1000 + len(spawned))

    monkeypatch.setattr(workers, "_spawn", spawn)
    return workers, spawned


def dead_child(index: int, *, up_for_s: float) -> ChildProcess:
    return ChildProcess(index, Spawned(4242), started_at=time.monotonic() - up_for_s)  # type: ignore[arg-type]


def test_a_child_that_died_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    workers, spawned = supervisor(monkeypatch)
    child = dead_child(1, up_for_s=600)
    assert workers.restart(child, -9)
    assert spawned == [1] and child.restarts == 1 and child.popen.pid == 1001


def test_a_bad_configuration_is_not_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    workers, spawned = supervisor(monkeypatch)
    assert not workers.restart(dead_child(0, up_for_s=600), FINAL_EXIT_CODE)
    assert spawned == []


def test_a_child_that_keeps_dying_at_start_ends_the_frontend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers, spawned = supervisor(monkeypatch)
    child = dead_child(0, up_for_s=1)
    outcomes = []
    for _ in range(MAX_QUICK_RESTARTS):
        outcomes.append(workers.restart(child, 1))
        child.started_at = time.monotonic() - 1  # died again a second after its start
    assert outcomes == [True] * (MAX_QUICK_RESTARTS - 1) + [False]
    assert len(spawned) == MAX_QUICK_RESTARTS - 1
