"""`free_port` hands out ports no outgoing connection can take before the server binds."""

from __future__ import annotations

import socket

from dynamo.runtime.ports import ephemeral_range, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    assert 0 < low <= high
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports), "never the same port twice in a process"
    assert all(port < low for port in ports), (low, sorted(ports)[-3:])
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free: nothing else binds them here
