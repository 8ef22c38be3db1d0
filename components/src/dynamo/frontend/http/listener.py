"""The listening socket of the HTTP server, with deadlines on idle connections and on
request heads, so that slow or silent clients cannot hold connections for ever.

aiohttp closes a connection that sits idle longer than its `keepalive_timeout`: idle
meaning waiting for a complete request head, counted from when the connection opened or
its previous response ended. Its default is an hour, which lets a "slowloris" client,
one that trickles a request head a byte at a time, keep a connection (a file descriptor
and a task) for an hour, and thousands of them at once. Two settings bound that here:

* the keep-alive timeout (`--keep-alive-timeout`) is aiohttp's own timer, shortened;
* the head timeout (`--header-timeout`) is added by `HeadDeadlineProtocol`: from the
  first byte of a request head, the client has that long until the head is complete and
  the request is handed to the application; otherwise the connection is closed. It can
  be shorter than the keep-alive timeout, which has to outlast a proxy's idle timeout.

The body has its own deadline (`request_body.BODY_READ_TIMEOUT_S`, 408), and a streamed
response one for a client that stops reading (`generation.py`, `--write-timeout`).

aiohttp offers no option for a head deadline, so `listen` builds the listening socket
itself, with `HeadDeadlineProtocol` (aiohttp's `RequestHandler` plus one timer) as the
protocol of each connection, for the `web.Server` an `AppRunner` set up.
`track_request_heads` is the middleware that tells the protocol when a request's head is
complete and when its handling ended.

Several processes on one port (`--http-workers N`, `http/workers.py`): each child calls
`share_port_across_processes()` once at start, and `listen` then binds with SO_REUSEPORT,
so every child has a listening socket of its own on the same port and the kernel spreads
new connections over them. A process-wide switch rather than an argument because it is a
property of the process (one of N), the same for every server it starts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from dynamo.runtime.cli import positive_float
from dynamo.runtime.settings import Flag, setting

log = logging.getLogger(__name__)
SHUTDOWN_DRAIN_S = 60.0
"""On SIGTERM, how long responses in flight may go on before the server closes them."""

# Longer than the 60 s idle timeout of common load balancers and proxies, so that they,
# not the frontend, close an idle pooled connection (no race with a request they send on
# it); nginx's own default is 75 s.
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 75.0
# A well-behaved client sends its request head in one packet; 30 s matches the body's
# deadline, so every part of a request must arrive within 30 s of its start.
DEFAULT_HEADER_TIMEOUT_S = 30.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_port_sharing = False


def port_sharing_supported() -> bool:
    """Whether this platform has SO_REUSEPORT (several processes listening on one port)."""
    return hasattr(socket, "SO_REUSEPORT")


def share_port_across_processes() -> None:
    """From now on, `listen` binds with SO_REUSEPORT: this process is one of several
    serving the same port (`--http-workers`). `OSError` where the platform cannot."""
    global _port_sharing
    if not port_sharing_supported():
        raise OSError("this platform has no SO_REUSEPORT")
    _port_sharing = True


@dataclass(frozen=True)
class ConnectionTimeouts:
    """How long a connection may idle and how long a request head may take (seconds)."""

    keep_alive_s: float = setting(
        DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        Flag(
            "--keep-alive-timeout",
            "Seconds an idle client connection is kept open (from its opening or its last "
            "response until a complete request head). $DYN_HTTP_KEEP_ALIVE_TIMEOUT overrides "
            "the default.",
            type=positive_float,
            env="DYN_HTTP_KEEP_ALIVE_TIMEOUT",
        ),
    )
    header_s: float = setting(
        DEFAULT_HEADER_TIMEOUT_S,
        Flag(
            "--header-timeout",
            "Seconds a client has, from the first byte of a request, to send the complete "
            "request head; the connection is closed otherwise (slow-header clients). "
            "$DYN_HTTP_HEADER_TIMEOUT overrides the default.",
            type=positive_float,
            env="DYN_HTTP_HEADER_TIMEOUT",
        ),
    )

    def __post_init__(self) -> None:
        if self.keep_alive_s <= 0 or self.header_s <= 0:
            raise ValueError(f"connection timeouts must be positive, got {self}")


class HeadDeadlineProtocol(web.RequestHandler):
    """aiohttp's connection protocol with a deadline on each request head: armed by the
    first bytes that arrive while no request is being handled, cancelled when a request's
    handling starts (`request_started`), and closing the connection when it fires."""

    __slots__ = ("_head_timeout", "_head_timer", "_serving", "_timer_loop")

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        head_timeout: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._timer_loop = loop
        self._head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._serving = False

    def data_received(self, data: bytes) -> None:
        if not self._serving and self._head_timer is None:
            self._head_timer = self._timer_loop.call_later(self._head_timeout, self._expired)
        super().data_received(data)

    def request_started(self) -> None:
        """A complete head was parsed and its request is being handled."""
        self._serving = True
        self._cancel_timer()

    def request_finished(self) -> None:
        """The handler returned; the next bytes start the next request's head."""
        self._serving = False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def _expired(self) -> None:
        self._head_timer = None
        if not self._serving:
            log.info(
                "closing a connection whose request head did not arrive within %gs",
                self._head_timeout,
            )
            self.force_close()

    def _cancel_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


@web.middleware
async def track_request_heads(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tell the connection's `HeadDeadlineProtocol` that a request's head is complete and,
    later, that its handling ended. Must be the outermost middleware."""
    protocol = request.protocol
    if not isinstance(protocol, HeadDeadlineProtocol):  # an app served some other way
        return await handler(request)
    protocol.request_started()
    try:
        return await handler(request)
    finally:
        protocol.request_finished()


async def listen(
    runner: web.AppRunner,
    host: str,
    port: int,
    timeouts: ConnectionTimeouts,
    **handler_options: Any,
) -> asyncio.Server:
    """Listen on host:port for `runner` (already set up), each connection served by a
    `HeadDeadlineProtocol`; `handler_options` are aiohttp's `RequestHandler` options.
    Close the returned server before `runner.cleanup()`."""
    server = runner.server
    if server is None:
        raise RuntimeError("listen() needs an AppRunner that was set up")
    loop = asyncio.get_running_loop()

    def protocol() -> HeadDeadlineProtocol:
        return HeadDeadlineProtocol(
            server,
            loop=loop,
            head_timeout=timeouts.header_s,
            keepalive_timeout=timeouts.keep_alive_s,
            **handler_options,
        )

    return await loop.create_server(
        protocol, host, port, reuse_address=True, reuse_port=_port_sharing or None
    )
