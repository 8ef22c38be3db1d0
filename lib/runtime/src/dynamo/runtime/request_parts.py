"""A request larger than one NATS message: split by the client, joined by the server.

NATS refuses a message over its server's `max_payload` (1 MiB by default). A request can
legitimately be larger: a long prompt on a long-context model (a 256k-token prompt is about
a megabyte of token ids), its migration continuation (prompt plus what was generated), a
large schema or choice list. Such a request travels as numbered parts, each published to
the instance's request subject with the stream's reply inbox and a `Dynamo-Part: i/n`
header; the server joins them and serves the whole as one request. Messages one connection
publishes on one subject reach a subscriber in order, so a part out of sequence means one
was lost (a reconnect between two parts): the request is answered with an error and the
client's stream ends, as for any lost frame.

Bounds, because a server holds the parts in memory until the last one arrives:

* `MAX_CARRIED_REQUEST_BYTES` a request: anything larger is `RequestTooLargeError` at the
  client, before anything is sent (what can never be served is refused, not carried);
* `MAX_JOINING_BYTES` across the requests a server is joining at once: a request that would
  go over is refused as overloaded, so the client places it on another instance;
* parts that stop coming (the client died, or was cancelled, mid-send) are dropped
  `JOIN_TIMEOUT_S` after the last one (checked as parts arrive).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

PART_HEADER = "Dynamo-Part"
PART_OVERHEAD_BYTES = 1024
"""Room kept in each part for the message's subjects and headers (NATS counts headers
against `max_payload`)."""

MAX_CARRIED_REQUEST_BYTES = 64 * 1024 * 1024
MAX_JOINING_BYTES = 256 * 1024 * 1024
JOIN_TIMEOUT_S = 30.0


class PartError(Exception):
    """A part that cannot be joined; the message says why (sent to the client)."""


class JoinerFullError(PartError):
    """Joining this request would exceed `MAX_JOINING_BYTES`: another instance should take it."""


def split(payload: bytes, max_payload: int) -> list[bytes]:
    """`payload` cut into parts that each fit one message of `max_payload` bytes."""
    size = max(1, max_payload - PART_OVERHEAD_BYTES)
    return [payload[i : i + size] for i in range(0, len(payload), size)]


def part_headers(index: int, count: int) -> dict[str, str]:
    return {PART_HEADER: f"{index}/{count}"}


def part_of(headers: Mapping[str, str] | None) -> tuple[int, int] | None:
    """(index, count) of a part; None for a request sent whole. Raises `PartError` for a
    header that is not `i/n` with 0 <= i < n."""
    if not headers or PART_HEADER not in headers:
        return None
    value = headers[PART_HEADER]
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit()) or int(index) >= int(count):
        raise PartError(f"malformed {PART_HEADER} header {value!r}")
    return int(index), int(count)


@dataclass
class _Joining:
    count: int
    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    last_part_at: float = 0.0


class RequestJoiner:
    """Joins the parts of the requests an endpoint receives, keyed by reply inbox."""

    def __init__(
        self,
        *,
        max_request_bytes: int = MAX_CARRIED_REQUEST_BYTES,
        max_joining_bytes: int = MAX_JOINING_BYTES,
        timeout_s: float = JOIN_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_request_bytes = max_request_bytes
        self.max_joining_bytes = max_joining_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._joining: dict[str, _Joining] = {}
        self._bytes = 0
        self.requests_joined = 0
        self.requests_dropped = 0

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def __contains__(self, reply: object) -> bool:
        return reply in self._joining

    def add(self, reply: str, index: int, count: int, data: bytes) -> bytes | None:
        """Take one part; returns the whole request with its last part, else None.

        Raises `PartError` (the request is dropped) for a part out of sequence or a request
        over `max_request_bytes`, and `JoinerFullError` when joining it would exceed
        `max_joining_bytes`."""
        now = self._clock()
        self.expire(now)
        joining = self._joining.get(reply)
        if joining is None:
            if index != 0:
                raise PartError(f"request part {index} of {count} arrived without the first")
            joining = self._joining[reply] = _Joining(count)
        elif index != len(joining.parts) or count != joining.count:
            self.discard(reply)
            raise PartError(
                f"request part {index}/{count} arrived after part "
                f"{len(joining.parts) - 1}/{joining.count}: a part was lost"
            )
        if joining.size + len(data) > self.max_request_bytes:
            self.discard(reply)
            raise PartError(f"the request is over {self.max_request_bytes} bytes")
        if self._bytes + len(data) > self.max_joining_bytes:
            self.discard(reply)
            raise JoinerFullError(
                f"the worker is joining {self._bytes} bytes of large requests, its bound"
            )
        joining.parts.append(data)
        joining.size += len(data)
        joining.last_part_at = now
        self._bytes += len(data)
        if len(joining.parts) < joining.count:
            return None
        del self._joining[reply]
        self._bytes -= joining.size
        self.requests_joined += 1
        return b"".join(joining.parts)

    def discard(self, reply: str) -> bool:
        """Drop a request being joined (its client cancelled, or a part was bad)."""
        joining = self._joining.pop(reply, None)
        if joining is None:
            return False
        self._bytes -= joining.size
        self.requests_dropped += 1
        return True

    def expire(self, now: float | None = None) -> int:
        """Drop requests whose next part has not come within `timeout_s`."""
        now = self._clock() if now is None else now
        stale = [r for r, j in self._joining.items() if now - j.last_part_at > self.timeout_s]
        for reply in stale:
            self.discard(reply)
        return len(stale)
