"""The nats-server manager: ephemeral ports, readiness, restart on the same port and store,
reuse of a reachable `$NATS_SERVER`."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.nats_server import NatsServer, NatsServerError, ensure_nats_server
from dynamo.runtime.nats_address import is_reachable


def test_start_stop_restart_keeps_port_and_store(tmp_path: Path) -> None:
    server = NatsServer(store_dir=tmp_path / "js")
    server.start()
    try:
        assert server.running and is_reachable(server.url)
        port = server.port
        server.stop()
        assert not is_reachable(server.url)
        server.start()
        assert server.port == port and is_reachable(server.url)
        assert (tmp_path / "js").is_dir()
    finally:
        server.close()
    assert not server.running


def test_ensure_reuses_a_reachable_server(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_SERVER", nats_url)
    url, started = ensure_nats_server()
    assert url == nats_url and started is None


def test_ensure_starts_one_when_none_is_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_SERVER", raising=False)
    url, started = ensure_nats_server()
    try:
        assert started is not None and is_reachable(url)
    finally:
        assert started is not None
        started.close()


def test_port_in_use_is_a_clear_error(nats_server: NatsServer) -> None:
    with pytest.raises(NatsServerError):
        NatsServer(port=nats_server.port).start(timeout=3)
