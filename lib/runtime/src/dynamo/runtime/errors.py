"""Typed errors of the runtime.

Client side: callers catch these instead of transport errors: a frontend maps
`NoInstancesError` to 503, places a request on another worker after `InstanceGoneError`
when nothing was streamed yet, or after `InstanceOverloadedError` (the worker refused it),
and reports `RemoteError.message` (the handler's own exception text), as the client's
error when its `kind` is `ErrorKind.INVALID_REQUEST`.

Serving side: a handler raises a `RequestRefusedError` (`InvalidRequestError`,
`WorkerOverloadedError`) to end a request with a typed error frame instead of an
anonymous failure, so the caller can tell "your request is wrong" and "try elsewhere"
from "the engine failed".
"""

from __future__ import annotations

from typing import ClassVar

from dynamo.runtime.wire import ErrorKind, error_kind


class DynamoRuntimeError(Exception):
    """Base class of every runtime error."""


class NoInstancesError(DynamoRuntimeError):
    """No live instance serves the endpoint (or the chosen instance is unknown)."""


class InstanceGoneError(DynamoRuntimeError):
    """The instance serving a request disappeared: its lease expired, it deregistered, or
    it had no subscriber when the request was sent."""

    def __init__(self, instance_id: int, detail: str = "") -> None:
        self.instance_id = instance_id
        super().__init__(f"instance {instance_id:016x} is gone" + (f": {detail}" if detail else ""))


class NoResponderError(InstanceGoneError):
    """NATS answered "no responders" for the instance's subject: nothing was delivered, so
    nothing ran there. The instance may be dead (its key lives on until its lease
    expires) or only between two connections (a worker reconnecting after losing its
    NATS node has no subscription for a moment): the caller may send the request to it
    again later."""

    def __init__(self, instance_id: int) -> None:
        super().__init__(instance_id, "no responder on its subject")


class ConnectionLostError(InstanceGoneError):
    """This process lost its NATS connection while the stream was open. The instance may
    be alive and still working (closing the stream sends it a STOP once reconnected), but
    frames it sent while no server held this process's interest are gone, and one of
    them may have been the END: the stream cannot be trusted to go on. A caller treats it
    as a lost instance (place again, or migrate) without blaming the instance."""

    def __init__(self, instance_id: int, detail: str = "") -> None:
        self.instance_id = instance_id
        DynamoRuntimeError.__init__(
            self,
            f"stream from instance {instance_id:016x} cut: this process's NATS connection "
            "dropped" + (f" ({detail})" if detail else ""),
        )


class FramesLostError(ConnectionLostError):
    """Frames of the stream never arrived: their numbers skip. The instance's own NATS
    connection dropped and took what it had written but the server had not routed yet
    (after reconnecting it sends a late frame to each stream that ended just before, so a
    lost END shows as a skip too). Handled as a cut stream: placed again or migrated,
    without blaming the instance, which is alive."""

    def __init__(self, instance_id: int, expected: int, got: int) -> None:
        self.instance_id = instance_id
        DynamoRuntimeError.__init__(
            self,
            f"stream from instance {instance_id:016x} lost frames {expected} to {got - 1} "
            "in transit (its NATS connection dropped)",
        )


class InstanceOverloadedError(DynamoRuntimeError):
    """The instance refused the request before running any of it: it already serves as
    many requests as it accepts. Nothing happened there, so another instance may take it."""

    def __init__(self, instance_id: int, detail: str = "") -> None:
        self.instance_id = instance_id
        super().__init__(
            f"instance {instance_id:016x} is overloaded" + (f": {detail}" if detail else "")
        )


class RequestTooLargeError(DynamoRuntimeError):
    """The request is larger than the runtime carries (`request_parts`: requests over one
    NATS message travel in parts, up to a bound): nothing was sent. Any instance would
    refuse it the same way, so it is the caller's to shorten."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"the request is {size} bytes on the wire; the runtime carries at most "
            f"{limit} bytes a request"
        )


class RemoteError(DynamoRuntimeError):
    """The remote handler raised; `message` is its text, `remote_type` its class name (or
    the reserved name of its kind), `kind` what it means to the caller."""

    def __init__(self, message: str, remote_type: str = "Exception") -> None:
        self.message = message
        self.remote_type = remote_type
        self.kind = error_kind(remote_type)
        super().__init__(f"{remote_type}: {message}")


def error_from_frame(instance_id: int, error_type: str, message: str) -> DynamoRuntimeError:
    """The error a client raises for an ERROR frame from `instance_id`: a worker that
    shut down is gone, one that refused the request is overloaded, anything else is the
    handler's error."""
    kind = error_kind(error_type)
    if kind is ErrorKind.SHUTDOWN:
        return InstanceGoneError(instance_id, message)
    if kind is ErrorKind.OVERLOADED:
        return InstanceOverloadedError(instance_id, message)
    return RemoteError(message, error_type)


class RequestRefusedError(Exception):
    """Raised by a handler to refuse a request with a typed error frame of `kind` (its
    text is the frame's message: one clean line, it reaches the end client)."""

    kind: ClassVar[ErrorKind]


class InvalidRequestError(RequestRefusedError):
    """The request is the caller's fault (parameters the engine refuses): clients receive
    a `RemoteError` of kind `INVALID_REQUEST`, and the frontend answers HTTP 400."""

    kind = ErrorKind.INVALID_REQUEST


class WorkerOverloadedError(RequestRefusedError):
    """The engine cannot take the request now (its queue is full). Raise it before
    yielding anything: clients receive `InstanceOverloadedError` and place the request on
    another instance. Raised after outputs were sent it is reported as an ordinary error,
    since the caller could not resend the request without repeating them."""

    kind = ErrorKind.OVERLOADED


class StreamTimeoutError(DynamoRuntimeError, TimeoutError):
    """No frame arrived within the caller's timeout (the first item's, or the one between
    items): the instance still holds its lease but stopped answering this request."""

    def __init__(self, message: str, instance_id: int | None = None) -> None:
        self.instance_id = instance_id
        super().__init__(message)


class RequestNotAcceptedError(StreamTimeoutError):
    """The instance did not confirm the request in time: it never reached the handler
    (lost with a NATS node that failed while routing it) or the instance is frozen.
    Nothing was produced, so the request may be placed elsewhere."""


class ClientClosedError(DynamoRuntimeError):
    """The `Client` a stream was opened through was closed: it no longer watches the
    instances, so it could not tell the stream that its instance went away."""


class StreamProtocolError(DynamoRuntimeError):
    """Frames arrived out of order or malformed (e.g. dropped by a slow consumer)."""


class RuntimeClosedError(DynamoRuntimeError):
    """The runtime was shut down."""
