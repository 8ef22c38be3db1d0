"""A streaming OpenAI completions client that records what a fault test needs to see.

Fault tests ask more of a stream than the `openai` client shows: when each chunk arrived,
whether the stream ended with `[DONE]`, with an in-band error event (`data: {"error":
...}`, sent once the status line is out), or with an HTTP error before any chunk, and the
usage chunk. `stream_completion` reads the SSE body of `POST /v1/completions` line by line
with aiohttp and returns a `StreamOutcome`; `on_chunk` lets a test act at a given point of
the stream (kill a worker after the fifth chunk, say) without a second reader.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

ChunkListener = Callable[["StreamOutcome"], None]
"""Called after each completion chunk is recorded, with the outcome so far."""


@dataclass
class StreamOutcome:
    """What one streaming completion delivered."""

    status: int
    texts: list[str] = field(default_factory=list)  # choices[0].text of each chunk
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # the error event's "error", or the HTTP error body
    done: bool = False  # `data: [DONE]` arrived
    ended_at: float = 0.0  # time.monotonic() when the response ended

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def completed(self) -> bool:
        """Ended normally: `[DONE]`, no error, a finish reason."""
        return self.done and self.error is None and self.finish_reason is not None


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The payload of each `data:` line of a server-sent events body, as it arrives
    (`[DONE]` included); other lines are skipped."""
    async for raw in content:
        line = raw.decode().strip()
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    body: Mapping[str, Any],
    *,
    on_chunk: ChunkListener | None = None,
) -> StreamOutcome:
    """POST `body` (with `"stream": true` added) to `base_url`/v1/completions and read the
    stream to its end; connection errors raise `aiohttp.ClientError`."""
    payload = {**body, "stream": True}
    async with session.post(f"{base_url}/v1/completions", json=payload) as resp:
        outcome = StreamOutcome(status=resp.status)
        if resp.status != 200:
            outcome.error = _error_of(await resp.text())
            outcome.ended_at = time.monotonic()
            return outcome
        async for data in sse_data(resp.content):
            if data == "[DONE]":
                outcome.done = True
                break
            _record(outcome, json.loads(data), on_chunk)
    outcome.ended_at = time.monotonic()
    return outcome


def _record(outcome: StreamOutcome, event: dict[str, Any], on_chunk: ChunkListener | None) -> None:
    if "error" in event:
        outcome.error = event["error"]
        return
    if event.get("usage"):
        outcome.usage = event["usage"]
    choices = event.get("choices") or []
    if not choices:
        return
    choice = choices[0]
    outcome.texts.append(choice.get("text") or "")
    outcome.chunk_times.append(time.monotonic())
    if choice.get("finish_reason"):
        outcome.finish_reason = choice["finish_reason"]
    if on_chunk is not None:
        on_chunk(outcome)


def _error_of(text: str) -> dict[str, Any]:
    try:
        body = json.loads(text)
    except ValueError:
        return {"message": text}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {"message": text}
