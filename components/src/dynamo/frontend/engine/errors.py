"""The engine client's errors, and which of them a runtime failure becomes.

Separate from `client.py` because every engine client (`RuntimeEngineClient`, the
disaggregated and beam-search compositions, the in-memory test engine), the placement
policy (`request_legs.py`) and the HTTP layer, which maps each type to a status, share
these types; none of them needs `RuntimeEngineClient` for that.
"""

from __future__ import annotations

from dynamo.runtime import (
    ClientClosedError,
    DynamoRuntimeError,
    ErrorKind,
    NoInstancesError,
    RemoteError,
    RequestTooLargeError,
    StreamTimeoutError,
)


class EngineUnavailableError(Exception):
    """No worker can take the request right now (HTTP 503)."""


class EngineOverloadedError(EngineUnavailableError):
    """Workers exist but none takes more work now: every one tried refused the request
    (its bound of requests in flight), or the router judged them all busy (HTTP 503 with
    `Retry-After`)."""


class EngineFailedError(Exception):
    """The worker failed the request (HTTP 500, or an error event mid-stream)."""


class EngineRejectedError(Exception):
    """The worker refused the request's parameters: the client's error (HTTP 400), with
    the engine's one-line reason."""


def engine_error(exc: DynamoRuntimeError, *, resuming: bool) -> Exception:
    """The engine-client error a stream failure that cannot be retried becomes (its HTTP
    status follows from the type)."""
    if isinstance(exc, ClientClosedError):
        return (
            EngineFailedError(f"worker lost: {exc}")
            if resuming
            else EngineUnavailableError(str(exc))
        )
    if isinstance(exc, NoInstancesError):
        if resuming:
            return EngineFailedError(f"worker lost and no instance to continue on: {exc}")
        return EngineUnavailableError(str(exc))
    if isinstance(exc, RequestTooLargeError):
        if resuming:  # the prompt plus the tokens so far outgrew one message
            return EngineFailedError(f"worker lost and the request cannot continue: {exc}")
        return EngineRejectedError(
            f"{exc}; shorten the prompt or the request's lists (stop_token_ids, choices)"
        )
    if isinstance(exc, RemoteError):
        if exc.kind is ErrorKind.INVALID_REQUEST:
            return EngineRejectedError(exc.message)
        return EngineFailedError(exc.message)
    return EngineFailedError(f"{type(exc).__name__}: {exc}")  # protocol errors, shutdown


def lost_message(exc: DynamoRuntimeError) -> str:
    """How a lost worker reads in an error message: silent past a deadline, or gone."""
    if isinstance(exc, StreamTimeoutError):
        return f"worker stopped responding: {exc}"
    return f"worker lost during the request: {exc}"
