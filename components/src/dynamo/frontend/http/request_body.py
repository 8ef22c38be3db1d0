"""Reading a request body under the two bounds that protect the server from its clients:
a size limit (413 beyond it, chunked bodies included) and a deadline for the whole body
(408 for a client that stops sending mid-body).

Separate from `server.py` because it is the one place that touches the raw body stream;
the request head has its own deadline in `listener.py`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from dynamo.frontend.openai.errors import payload_too_large, request_timeout

_READ_CHUNK = 256 * 1024
# Longest wait for a request body to arrive completely.
BODY_READ_TIMEOUT_S = 30.0


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes (413 beyond). A client that stops sending
    mid-body gets a 408 instead of holding the handler forever."""
    try:
        return await asyncio.wait_for(_read_limited(request, limit), BODY_READ_TIMEOUT_S)
    except TimeoutError as exc:
        raise request_timeout() from exc


async def _read_limited(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise payload_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:  # also bounds chunked bodies, which declare no length
        chunk = await request.content.read(_READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise payload_too_large(limit)
        chunks.append(chunk)
