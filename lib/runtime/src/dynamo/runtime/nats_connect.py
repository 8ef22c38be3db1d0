"""Opening a process's NATS connection, with a first attempt that ends.

nats-py, told to reconnect forever (as a runtime must be, to ride out broker restarts),
also retries its *first* connection forever, whatever the failure: a server that refuses
our credentials or our TLS settings makes `connect` hang without a word. Here the first
connection is bounded: a refusal that retrying cannot cure (wrong or missing credentials,
a certificate the other side does not accept) fails at once with `NatsRefusedError`, any
other failure after `timeout` seconds with `ConnectionError` carrying the last error.
Once connected, reconnects are nats-py's, unbounded as before. Every message shows the URL
redacted (`nats_options.redact_url`).

TLS, when asked for (`--nats-tls-*`, or a `tls://` URL), is required, not offered:
nats-py upgrades a connection only when the server's plaintext INFO says `tls_required`,
so a fake server, or anyone on the path rewriting INFO, would receive CONNECT with the
credentials in clear. `TlsRequiringClient` refuses such a server after its INFO and
before CONNECT, on the first connection and on every reconnect (`TlsNotOfferedError`, a
refusal: the first connection fails at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.errors import AuthorizationError
from nats.errors import Error as NatsError

from dynamo.runtime.nats_options import (
    NatsConnectOptions,
    is_tls_url,
    redact_url,
    split_urls,
)

ErrorCallback = Callable[[Exception], Awaitable[None]]

_REFUSAL_MARKERS = (
    "authorization violation",
    "authentication expired",
    "authentication revoked",
)
"""Server error texts (`-ERR '...'`) that mean "not with these credentials". Not
"Authentication Timeout": a client too slow to authenticate (a loaded machine) may well
succeed on the next attempt."""

_TRANSIENT_TLS_ERRORS = (ssl.SSLEOFError, ssl.SSLZeroReturnError)
"""TLS failures that say only that the connection went away mid-handshake."""


class TlsNotOfferedError(NatsError):
    """The server did not ask for TLS although this client requires it: nothing was sent.
    (A nats-py error type, so nats-py's connect and reconnect loops treat it as a failed
    attempt at that server.)"""


class TlsRequiringClient(NatsClient):
    """nats-py's client, refusing a server whose INFO does not require TLS when this
    client was configured for TLS. The check runs where nats-py reads INFO (its
    `_process_info` hook, called before CONNECT is written on every connect and
    reconnect), so credentials never leave unencrypted."""

    def __init__(self, require_tls: bool) -> None:
        super().__init__()
        self.require_tls = require_tls

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and self.require_tls and not info.get("tls_required"):
            raise TlsNotOfferedError(
                "nats: the server did not ask for TLS, which this client requires "
                "(--nats-tls-* or a tls:// URL); nothing was sent to it"
            )
        await super()._process_info(info, initial_connection)


class NatsRefusedError(ConnectionError):
    """The NATS server refused this client: its credentials, or the TLS handshake.
    Retrying with the same settings cannot help."""


def is_refusal(exc: BaseException) -> bool:
    """True for errors that say the server will not accept this client as configured:
    an authorization violation, or a TLS handshake that failed on a certificate (ours
    not accepted, or theirs not verified)."""
    if isinstance(exc, AuthorizationError | TlsNotOfferedError):
        return True
    if isinstance(exc, ssl.SSLError):
        return not isinstance(exc, _TRANSIENT_TLS_ERRORS)
    text = str(exc).lower()
    return any(marker in text for marker in _REFUSAL_MARKERS)


async def open_nats_connection(
    server: str,
    options: NatsConnectOptions,
    *,
    timeout: float,
    error_cb: ErrorCallback,
    **connect_kwargs: Any,
) -> NatsClient:
    """A connected client for `server` (one URL, or a cluster's URLs comma-separated:
    nats-py connects to one and fails over to the others) with `options`' credentials and TLS, plus nats-py
    `connect_kwargs` (callbacks, reconnect policy). Raises `NatsRefusedError` as soon as
    the server refuses us, `ConnectionError` after `timeout` seconds otherwise."""
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[BaseException] = loop.create_future()
    last_error: list[BaseException] = []
    connected = False

    async def on_error(exc: Exception) -> None:
        if not connected:
            last_error[:] = [exc]
            if is_refusal(exc) and not refused.done():
                refused.set_result(exc)
        await error_cb(exc)

    require_tls = options.uses_tls or any(is_tls_url(url) for url in split_urls(server))
    nc = TlsRequiringClient(require_tls)
    attempt = asyncio.ensure_future(
        nc.connect(
            servers=split_urls(server),
            error_cb=on_error,
            **connect_kwargs,
            **options.connect_kwargs(),
        )
    )
    try:
        await asyncio.wait({attempt, refused}, timeout=timeout, return_when="FIRST_COMPLETED")
    except asyncio.CancelledError:
        await _abandon(nc, attempt)
        raise
    if attempt.done():
        attempt.result()  # raises a failure nats-py itself gave up on
        connected = True
        return nc
    await _abandon(nc, attempt)
    shown = redact_url(server)
    if refused.done():
        raise NatsRefusedError(
            f"NATS at {shown} refused this client ({options.describe(server)}): "
            f"{refused.result()}"
            " (check the --nats-* settings / NATS_* variables)"
        )
    why = f": {last_error[0]}" if last_error else ""
    raise ConnectionError(f"could not connect to NATS at {shown} within {timeout:g}s{why}")


async def _abandon(nc: NatsClient, attempt: asyncio.Future[None]) -> None:
    """Stop a connect still retrying and release what it holds."""
    attempt.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await attempt
    with contextlib.suppress(Exception):
        await nc.close()
