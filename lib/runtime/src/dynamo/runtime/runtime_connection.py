"""The runtime's own NATS connection: opened once, then reconnecting forever.

Separate from `runtime.py`, which decides what to do when that connection drops and comes
back (restore leases, watches and listeners): this module holds how the connection itself
behaves. It waits for a server that is not up yet (nats-py would retry an absent server
forever), sets nats-py's reconnect and ping settings, and closes it in bounded time.
(`nats_connect.py` bounds the first connection attempt; `nats_address.py` says where the
server is.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient

from dynamo.runtime.nats_address import is_reachable
from dynamo.runtime.nats_connect import open_nats_connection
from dynamo.runtime.nats_options import NatsConnectOptions, redact_url
from dynamo.runtime.server import PUBLISH_FLUSH_TIMEOUT_S

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
"""The longest closing the NATS connection may take once the runtime is done with it
(nats-py first flushes what it buffered, which waits on a broker that may be gone)."""


async def open_reconnecting_connection(
    server: str,
    nats_options: NatsConnectOptions,
    *,
    name: str,
    connect_timeout: float,
    wait_for_server: float,
    reconnected_cb: Callable[[], Awaitable[None]],
    disconnected_cb: Callable[[], Awaitable[None]],
) -> NatsClient:
    """Wait for the server at `server` (up to `wait_for_server`, at least
    `connect_timeout`, seconds), then connect as `name-<pid>`, reconnecting forever with
    nats-py's `reconnected_cb` and `disconnected_cb` told of each reconnect and drop."""
    await wait_reachable(server, max(wait_for_server, connect_timeout))

    async def on_error(exc: Exception) -> None:
        log.debug("NATS error: %s", exc)

    return await open_nats_connection(
        server,
        nats_options,
        timeout=max(wait_for_server, 2 * connect_timeout),
        name=f"{name}-{os.getpid()}",
        connect_timeout=connect_timeout,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        ping_interval=2.0,
        max_outstanding_pings=2,  # a silent partition: 4-6 s, not 4 min
        allow_reconnect=True,
        reconnected_cb=reconnected_cb,
        disconnected_cb=disconnected_cb,
        error_cb=on_error,
        flush_timeout=PUBLISH_FLUSH_TIMEOUT_S,
    )


async def wait_reachable(url: str, timeout: float) -> None:
    """Poll the server's TCP port: nats-py itself would retry an absent server forever."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    logged = False
    shown = redact_url(url)
    while not await asyncio.to_thread(is_reachable, url, 0.5):
        if loop.time() >= deadline:
            raise ConnectionError(
                f"no NATS server at {shown} (start one with `python -m dynamo.nats_server` "
                f"or set $NATS_SERVER)"
            )
        if not logged:
            log.info("waiting for NATS at %s", shown)
            logged = True
        await asyncio.sleep(0.25)


async def close_connection_bounded(nc: NatsClient) -> None:
    """Close `nc` (stopping nats-py's reconnect loop), bounded: nats-py flushes what it
    buffered first, and the broker may be gone."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), CLOSE_TIMEOUT_S)
