"""Picking a free TCP port for a server that is started a moment later.

Binding port 0 and closing the socket gives a port from the kernel's ephemeral range
(`net.ipv4.ip_local_port_range`, 32768-60999 by default), the same range the kernel takes
outgoing connections' source ports from. Between the choice and the server's own bind any
connection on the machine may take that port as its source port, and the server then
fails with "address already in use". It happened: a NATS cluster node's route port was
taken by another node's connection while the three started together.

So ports are chosen below the ephemeral range, where only servers that bind a port
explicitly can collide: at random among the ports that bind right now, never the same
one twice in a process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000
"""The lowest port handed out (below: well-known services' habitual ports)."""
_TRIES = 200

_handed_out: set[int] = set()
_random = random.Random()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux's default where
    it cannot be read)."""
    try:
        low, high = _EPHEMERAL_RANGE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now and outside the ephemeral range (inside it,
    from binding port 0, only where the range leaves no room below it)."""
    low, _high = ephemeral_range()
    if low - 1 > _LOWEST:
        for _ in range(_TRIES):
            port = _random.randint(_LOWEST, low - 1)
            if port not in _handed_out and _binds(host, port):
                _handed_out.add(port)
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    _handed_out.add(port)
    return port


def _binds(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
