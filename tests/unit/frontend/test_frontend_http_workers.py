"""`--http-workers` and `--router-replica-sync` on the command line.

Claims: one process and replica sync on are the defaults, `$DYN_HTTP_WORKERS` and
`$DYN_ROUTER_REPLICA_SYNC` change them; fewer than one worker is refused by the parser;
where the platform lacks SO_REUSEPORT, `--http-workers 2` is refused with an `error:` line
and exit status 2 before anything starts; a child's command line is the parent's with one
worker and its index, and a child shares its port and reads the metrics directory its
parent made. (The processes themselves: tests/integration/frontend/test_http_workers.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.frontend import http_workers
from dynamo.frontend.__main__ import build_parser, config_from_args, main
from dynamo.frontend.http_workers import (
    WORKER_COUNT_FLAG,
    WORKER_INDEX_FLAG,
    HttpWorkerSlot,
    check_http_workers,
    child_argv,
)
from dynamo.runtime.cli import ConfigError


def test_one_process_and_replica_sync_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_HTTP_WORKERS", raising=False)
    monkeypatch.delenv("DYN_ROUTER_REPLICA_SYNC", raising=False)
    args = build_parser().parse_args([])
    config = config_from_args(args)
    assert args.http_workers == 1 and args.http_worker_index is None
    assert config.router_replica_sync is True
    assert (config.shared_port, config.metrics_dir) == (False, None)


def test_the_environment_sets_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HTTP_WORKERS", "3")
    monkeypatch.setenv("DYN_ROUTER_REPLICA_SYNC", "0")
    args = build_parser().parse_args([])
    assert args.http_workers == 3
    assert config_from_args(args).router_replica_sync is False
    args = build_parser().parse_args(["--http-workers", "1", "--router-replica-sync"])
    assert args.http_workers == 1 and config_from_args(args).router_replica_sync is True


def test_replica_sync_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_ROUTER_REPLICA_SYNC", raising=False)
    args = build_parser().parse_args(["--no-router-replica-sync"])
    assert config_from_args(args).router_replica_sync is False


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
