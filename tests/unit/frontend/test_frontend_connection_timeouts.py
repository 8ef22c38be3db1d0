"""Deadlines on connections, over raw sockets: an idle keep-alive connection is closed; a
request head trickled byte by byte ("slowloris") is cut at the header timeout while other
clients are served; neither deadline touches a request being handled (a long stream, a
slow body); a stream whose client stops reading is cut at the write timeout and its
request cancelled on the engine."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from frontend_support import MODEL, Frontend, Script
from http_support import chat, metric_value, running_frontend, send

from dynamo.frontend.http.listener import ConnectionTimeouts
from dynamo.testing.raw_http import closed_within, connect, read_response, trickle
from dynamo.testing.waiting import wait_until_async

HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    b"X-Padding: " + b"p" * 200 + b"\r\n"
)


@pytest.fixture
async def short(tokenizer: Any) -> AsyncIterator[Frontend]:
    timeouts = ConnectionTimeouts(keep_alive_s=1.5, header_s=0.3)
    async with running_frontend(tokenizer, timeouts=timeouts, write_timeout_s=0.5) as frontend:
        yield frontend


async def test_an_idle_keep_alive_connection_is_closed(short: Frontend) -> None:
    reader, writer = await connect(short.service.port)
    writer.write(b"GET /live HTTP/1.1\r\nHost: test\r\n\r\n")
    head, body = await read_response(reader)
    assert head.startswith(b"HTTP/1.1 200") and body == b'{"status":"live"}'
    waited = await closed_within(reader, 5.0)
    assert 1.0 < waited < 4.0, "closed by the keep-alive timeout (1.5 s)"
    writer.close()


async def test_a_trickled_request_head_is_cut_while_others_are_served(short: Frontend) -> None:
    reader, writer = await connect(short.service.port)
    served = []

    async def serve_another(i: int) -> None:
        if i % 10 == 0:
            served.append((await send(short.url, "/v1/chat/completions", chat())).status)

    # One byte every 20 ms: 4 s for the head, if allowed.
    held = await trickle(reader, writer, HEAD, 0.02, give_up_after=5.0, between=serve_another)
    assert held < 1.0, "cut at the header timeout (0.3 s), not later"
    assert served and set(served) == {200}, "other clients were served meanwhile"
    writer.close()


async def test_deadlines_do_not_cut_requests_being_handled(short: Frontend) -> None:
    # A stream far longer than both timeouts.
    short.engine.script = Script(delay=0.15)
    began = time.monotonic()
    reply = await send(short.url, "/v1/chat/completions", chat(stream=True))
    assert time.monotonic() - began > 0.8
    assert reply.status == 200 and reply.raw.endswith(b"data: [DONE]\n\n")
    # A body trickled over longer than the header timeout (its own deadline is 30 s).
    short.engine.script = Script()
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}]}' % MODEL.encode()
    reader, writer = await connect(short.service.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n")
    writer.write(b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    for i in range(0, len(body), 16):
        writer.write(body[i : i + 16])
        await writer.drain()
        await asyncio.sleep(0.15)
    head, answer = await read_response(reader)
    assert head.startswith(b"HTTP/1.1 200"), head
    # The same connection, idle for less than the keep-alive timeout but longer than the
    # header timeout, takes another request: the head deadline starts with its first byte.
    await asyncio.sleep(0.6)
    writer.write(b"GET /live HTTP/1.1\r\nHost: test\r\n\r\n")
    head, answer = await read_response(reader)
    assert head.startswith(b"HTTP/1.1 200") and answer == b'{"status":"live"}'
    writer.close()


async def test_a_stream_whose_client_stops_reading_is_cut_and_cancelled(
    short: Frontend,
) -> None:
    # Large events, produced fast and for ever.
    short.engine.script = Script(
        reply="lorem ipsum " * 30, steps=(20,), delay=0.002, never_finish=True
    )
    body = b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "Hi"}]}' % (
        MODEL.encode()
    )
    reader, writer = await connect(short.service.port, receive_buffer=4096)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n")
    writer.write(b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    writer.write(body)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    # ... and the client reads nothing more, but keeps the connection open. Small kernel
    # buffers on both ends (the server's would grow to megabytes on loopback) make the
    # frontend's own writes block within a second instead of a minute.
    (connection,) = short.service.connections
    server_socket = connection.transport.get_extra_info("socket")
    server_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    await wait_until_async(lambda: short.client.requests, timeout=5, what="the request to start")
    rid = short.client.requests[-1].request_id
    await wait_until_async(
        lambda: rid in short.client.cancelled,
        timeout=10,
        interval=0.05,
        what="the stalled stream's request to be cancelled on the engine",
    )
    assert metric_value(short, "dynamo_frontend_client_disconnects_total", model=MODEL) == 1
    assert short.service.admission.inflight(MODEL) == 0
    writer.close()
    short.engine.script = Script()
    assert (await send(short.url, "/v1/chat/completions", chat())).status == 200


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ConnectionTimeouts(keep_alive_s=0)
    with pytest.raises(ValueError):
        ConnectionTimeouts(header_s=-1)
