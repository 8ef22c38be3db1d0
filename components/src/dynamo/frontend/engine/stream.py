"""Reads an engine's output stream ahead of the HTTP writer, so that outputs that queued
up while the writer was busy are handed over together and go out in one write.

With speculative decoding and many concurrent streams, several engine steps often arrive
while the frontend is still writing the previous chunk; sending each as its own SSE
write costs a JSON encode and a syscall per step. A background task drains the engine
into a local queue; `next_batch()` waits for one output and takes everything else already
queued with it.

Closing (`aclose`) cancels the reader and closes the engine generator, which cancels the
request on the worker: the HTTP layer calls it when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from dynamo.llm.protocols import LLMEngineOutput

_END = object()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class EngineStream:
    """Batches of engine outputs, read ahead by a background task.

    `next_batch()` returns `[]` once the engine's stream has ended and re-raises an
    exception the engine stream raised (after delivering the outputs before it).
    """

    def __init__(self, outputs: AsyncGenerator[LLMEngineOutput, None]) -> None:
        self._outputs = outputs
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())
        self._ended = False

    async def _read(self) -> None:
        try:
            async for output in self._outputs:
                self._queue.put_nowait(output)
        except Exception as exc:  # handed to the consumer, raised from next_batch()
            self._queue.put_nowait(_Failure(exc))
            return
        self._queue.put_nowait(_END)

    async def next_batch(self) -> list[LLMEngineOutput]:
        """Wait for at least one output, then take all outputs already queued."""
        if self._ended:
            return []
        first = await self._queue.get()
        batch: list[LLMEngineOutput] = []
        item: object = first
        while True:
            if item is _END:
                self._ended = True
                break
            if isinstance(item, _Failure):
                self._ended = True
                if batch:  # deliver what came before the failure first
                    self._queue.put_nowait(item)
                    self._ended = False
                    break
                raise item.exc
            batch.append(item)  # type: ignore[arg-type]
            if self._queue.empty():
                break
            item = self._queue.get_nowait()
        return batch

    async def aclose(self) -> None:
        """Stop reading and close the engine stream (cancels the request upstream when it
        had not finished). Safe to call more than once."""
        self._ended = True
        if not self._reader.done():
            self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        with contextlib.suppress(Exception):
            await self._outputs.aclose()
