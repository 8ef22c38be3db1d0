"""HTTP/1.1 over a raw socket, for tests of what a server does to a connection.

An HTTP client library hides what connection-level tests need to control: when each byte
of a request goes out (a "slowloris" head trickled a byte at a time), how little the
client reads (a small receive buffer that fills), and whether the server closed the
connection rather than answered. These helpers write and read bytes on a plain
`asyncio` stream to 127.0.0.1 instead.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable


async def connect(
    port: int, *, receive_buffer: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to 127.0.0.1:`port`. `receive_buffer` sets `SO_RCVBUF` before
    connecting (the only time it bounds the TCP window), so that a client that stops
    reading makes the server's writes block within a second instead of a minute."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one response with a `Content-Length`."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection.

    A close is a FIN or a reset: when the server closes a socket that still holds bytes
    the client sent (a slowloris byte that arrived after the server gave up), the kernel
    answers with a reset instead of a FIN. Either way the server ended the connection, and
    anything it answered before a reset would be lost to us, so a reset reads as "closed,
    nothing more"."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """Seconds until the server closes the connection without sending anything more;
    fails (`TimeoutError`) after `seconds`."""
    began = time.monotonic()
    closing = await asyncio.wait_for(read_until_closed(reader), seconds)
    assert closing == b"", "the server sent more"
    return time.monotonic() - began


async def trickle(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    data: bytes,
    interval: float,
    *,
    give_up_after: float,
    between: Callable[[int], Awaitable[None]] | None = None,
) -> float:
    """Send `data` one byte every `interval` seconds, as a slowloris client does, until
    the server closes the connection; return the seconds from the first byte until it did.

    `between(i)` runs after byte `i` went out (to check that other clients are served
    meanwhile). Stops sending after `give_up_after` seconds, and fails if the server has
    not closed the connection (without an answer) `give_up_after` seconds after that."""
    eof = asyncio.ensure_future(read_until_closed(reader))
    began = time.monotonic()
    try:
        for i, byte in enumerate(data):
            if eof.done() or time.monotonic() - began > give_up_after:
                break
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:  # the server closed it while we wrote
                break
            if between is not None:
                await between(i)
            await asyncio.sleep(interval)
        closing = await asyncio.wait_for(eof, give_up_after)
    finally:
        eof.cancel()
    assert closing == b"", f"the server answered instead of closing: {closing[:200]!r}"
    return time.monotonic() - began
