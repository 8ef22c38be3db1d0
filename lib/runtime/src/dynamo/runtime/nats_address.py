"""Where this process finds NATS: the URL every component uses unless told otherwise, and
whether a server answers there.

Kept apart from the development server manager (`dynamo.nats_server`), which the runtime
never imports: the runtime only connects to a server, it does not run one."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from dynamo.runtime.nats_options import split_urls

ENV_NATS_SERVER = "NATS_SERVER"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def nats_url_from_env(default: str = DEFAULT_NATS_URL) -> str:
    """The NATS URL every component uses unless told otherwise: `$NATS_SERVER` or the default."""
    return os.environ.get(ENV_NATS_SERVER, "").strip() or default


def is_reachable(url: str, timeout: float = 0.5) -> bool:
    """True when any server of `url` (comma-separated) accepts TCP connections at its
    host:port and says INFO.

    Works for TLS servers too: nats-server sends its INFO in the clear before the TLS
    handshake."""
    return any(_says_info(one, timeout) for one in split_urls(url))


def _says_info(url: str, timeout: float) -> bool:
    parsed = urlparse(url if "://" in url else f"nats://{url}")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(4).startswith(b"INFO")
    except OSError:
        return False
