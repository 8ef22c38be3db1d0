"""Runs one prepared request on an engine and writes the HTTP response.

The flow is the same for both OpenAI endpoints; only the `ResponseFormatter` differs:

1. open the engine stream and wait for its first batch, so that "no worker" (503) or an
   engine failure (500) can still be reported with a proper status code;
2. stream: one SSE write per batch of engine outputs (outputs that queued up are
   coalesced by `EngineStream`), then the usage chunk and `[DONE]`;
   unary: accumulate and send one JSON body;
3. always close the engine stream: after a stop string, an error, or a client that went
   away, this cancels the request on the worker.

A streaming client that stops reading (but keeps its connection open) would otherwise
hold its request, its worker slot and a growing read-ahead queue for as long as the
generation lasts: a write that waits longer than `Generation.write_timeout_s` for the
client to take data aborts the connection, which ends the request like a disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from aiohttp import web

from dynamo.frontend.engine.busy_queue import BusyQueueError
from dynamo.frontend.engine.client import EngineClient
from dynamo.frontend.engine.errors import (
    EngineFailedError,
    EngineOverloadedError,
    EngineRejectedError,
    EngineUnavailableError,
)
from dynamo.frontend.engine.stream import EngineStream
from dynamo.frontend.http.admission import RETRY_AFTER_S
from dynamo.frontend.http.metrics import RequestMetrics
from dynamo.frontend.openai.errors import (
    OpenAIError,
    bad_request,
    engine_error,
    no_workers,
    overloaded,
)
from dynamo.frontend.postprocess.choices import ChoicePostprocessors
from dynamo.frontend.postprocess.formatters import ResponseFormatter
from dynamo.frontend.postprocess.postprocessor import TextDelta
from dynamo.frontend.preprocess.preprocessor import Prepared
from dynamo.llm.protocols import LLMEngineOutput

log = logging.getLogger(__name__)

# Status recorded for requests whose client disconnected (nginx's convention).
CLIENT_CLOSED = 499

# A write of at most this many bytes into an empty transport buffer cannot block (the
# transport pauses the writer only above its 64 KiB high-water mark), so it needs no
# timer: the common case, an SSE chunk to a client that keeps up, pays nothing.
_UNBLOCKABLE_WRITE = 16 * 1024

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not buffer the stream
}


@dataclass
class Generation:
    """Everything needed to serve one request."""

    model: str
    prepared: Prepared
    engine: EngineClient
    # One postprocessor per choice (`n`); the response ends when all choices have.
    postprocessor: ChoicePostprocessors
    formatter: ResponseFormatter
    metrics: RequestMetrics
    # Longest a streamed write may wait for the client to read; None: unbounded.
    write_timeout_s: float | None = None


class ClientStalled(ConnectionResetError):
    """The client stopped reading a stream: a write waited past the write timeout and the
    connection was aborted."""


async def serve(http_request: web.Request, gen: Generation) -> web.StreamResponse:
    """Run `gen` and return its HTTP response. Never leaves the engine stream open."""
    status = 500
    stream = EngineStream(gen.engine.generate(gen.prepared.request))
    try:
        first = await _next_batch(stream, gen.model)
        if gen.prepared.plan.stream:
            response, status = await _stream(http_request, gen, stream, first)
        else:
            response = await _unary(gen, stream, first)
            status = response.status
        return response
    except OpenAIError as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:  # the client went away (aiohttp cancels the handler)
        status = CLIENT_CLOSED
        gen.metrics.disconnected()
        raise
    finally:
        await stream.aclose()
        gen.metrics.spec_decode(gen.postprocessor.spec_stats)
        gen.metrics.finish(status)


async def _next_batch(stream: EngineStream, model: str) -> list[LLMEngineOutput]:
    try:
        return await stream.next_batch()
    except BusyQueueError as exc:  # waited in the busy queue, or found it full
        raise overloaded(model, exc.reason, RETRY_AFTER_S) from exc
    except EngineOverloadedError as exc:
        log.warning("workers of %s refuse more work: %s", model, exc)
        raise overloaded(model, "every worker is busy", RETRY_AFTER_S) from exc
    except EngineRejectedError as exc:  # the engine refused the request's parameters
        raise bad_request(str(exc)) from exc
    except EngineUnavailableError as exc:
        log.warning("no worker for %s: %s", model, exc)
        raise no_workers(model) from exc
    except EngineFailedError as exc:
        raise engine_error(str(exc)) from exc
    except Exception as exc:  # a transport bug must still end as an OpenAI error
        log.exception("engine stream for %s failed unexpectedly", model)
        raise engine_error(f"{type(exc).__name__}: {exc}") from exc


def _process(gen: Generation, batch: list[LLMEngineOutput]) -> list[TextDelta]:
    """The deltas of a batch, one per choice it touched (an empty batch: the stream ended
    and the unfinished choices are aborted)."""
    deltas = gen.postprocessor.process(batch) if batch else gen.postprocessor.end_of_stream()
    gen.metrics.tokens(sum(delta.token_count for delta in deltas))
    return deltas


def _error_of(deltas: list[TextDelta]) -> str | None:
    return next((delta.error for delta in deltas if delta.error is not None), None)


async def _unary(
    gen: Generation, stream: EngineStream, batch: list[LLMEngineOutput]
) -> web.Response:
    while True:
        deltas = _process(gen, batch)
        error = _error_of(deltas)
        if error is not None:
            raise engine_error(error)
        for delta in deltas:
            gen.formatter.add(delta)
        if gen.postprocessor.finished:
            break
        batch = await _next_batch(stream, gen.model)
    body = gen.formatter.body(gen.postprocessor.usage(), gen.postprocessor.metrics())
    return web.Response(
        body=body,
        content_type="application/json",
        headers={"X-Request-Id": gen.prepared.request.request_id},
    )


async def _stream(
    http_request: web.Request,
    gen: Generation,
    stream: EngineStream,
    batch: list[LLMEngineOutput],
) -> tuple[web.StreamResponse, int]:
    """Write SSE events until the response ends; returns (response, status for metrics)."""
    response = web.StreamResponse(
        headers={**SSE_HEADERS, "X-Request-Id": gen.prepared.request.request_id}
    )
    await response.prepare(http_request)
    try:
        transport = http_request.transport
        status, tail = await _write_events(response, transport, gen, stream, batch)
        # The last events go out with the end of the chunked body: one write, not two.
        await _bounded(response.write_eof(tail), transport, len(tail), gen.write_timeout_s)
    except ClientStalled as exc:
        log.warning("request %s: %s", gen.prepared.request.request_id, exc)
        gen.metrics.disconnected()
        status = CLIENT_CLOSED
    except ConnectionResetError:  # the client closed the connection under a write
        gen.metrics.disconnected()
        status = CLIENT_CLOSED
    return response, status


async def _write(
    response: web.StreamResponse,
    transport: asyncio.Transport | None,
    payload: bytes,
    timeout: float | None,
) -> None:
    await _bounded(response.write(payload), transport, len(payload), timeout)


async def _bounded(
    write: Awaitable[None],
    transport: asyncio.Transport | None,
    size: int,
    timeout: float | None,
) -> None:
    """Await `write` (of `size` bytes), bounded by `timeout` when it could block;
    `ClientStalled` (after aborting the connection) when the client did not read in time.
    (`transport` None: the connection is gone and the write raises.)"""
    if (
        timeout is None
        or transport is None
        or (transport.get_write_buffer_size() == 0 and size <= _UNBLOCKABLE_WRITE)
    ):
        await write
        return
    try:
        async with asyncio.timeout(timeout):
            await write
    except TimeoutError:
        transport.abort()
        raise ClientStalled(
            f"the client read nothing for {timeout:g}s; connection closed"
        ) from None


async def _write_events(
    response: web.StreamResponse,
    transport: asyncio.Transport | None,
    gen: Generation,
    stream: EngineStream,
    batch: list[LLMEngineOutput],
) -> tuple[int, bytes]:
    """Write events until the response ends; returns the status for metrics and the
    last events, which the caller writes together with the end of the body."""
    status = 200
    while True:
        deltas = _process(gen, batch)
        error = _error_of(deltas)
        payload = b"".join(gen.formatter.events(delta) for delta in deltas)
        if error is not None:
            status = 500
            payload += gen.formatter.failure_event(engine_error(error))
        if gen.postprocessor.finished:
            return status, payload + _trailer(gen, error)
        if payload:
            await _write(response, transport, payload, gen.write_timeout_s)
        try:
            batch = await _next_batch(stream, gen.model)
        except OpenAIError as exc:
            # Headers are out: report in-band, as OpenAI does, and end the stream.
            log.warning("engine failed mid-stream for %s: %s", gen.model, exc.message)
            return exc.status, gen.formatter.failure_event(exc) + gen.formatter.end_of_stream()


def _trailer(gen: Generation, error: str | None) -> bytes:
    """Usage chunk (when asked for and the response did not fail) and the formatter's end
    of stream (`[DONE]` for chat and completions)."""
    if error is None and gen.prepared.plan.include_usage:
        usage, metrics = gen.postprocessor.usage(), gen.postprocessor.metrics()
        return gen.formatter.usage_event(usage, metrics) + gen.formatter.end_of_stream()
    return gen.formatter.end_of_stream()
