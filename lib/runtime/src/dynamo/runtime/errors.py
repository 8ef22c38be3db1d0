"""Typed errors the runtime raises on the client side.

Callers catch these instead of transport errors: a frontend maps `NoInstancesError` to 503,
retries a request on another worker after `InstanceGoneError` when nothing was streamed
yet, and reports `RemoteError.message` (the handler's own exception text).
"""

from __future__ import annotations


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


class RemoteError(DynamoRuntimeError):
    """The remote handler raised; `message` is its text, `remote_type` its class name."""

    def __init__(self, message: str, remote_type: str = "Exception") -> None:
        self.message = message
        self.remote_type = remote_type
        super().__init__(f"{remote_type}: {message}")


class StreamTimeoutError(DynamoRuntimeError, TimeoutError):
    """No frame arrived within the caller's timeout."""


class StreamProtocolError(DynamoRuntimeError):
    """Frames arrived out of order or malformed (e.g. dropped by a slow consumer)."""


class RuntimeClosedError(DynamoRuntimeError):
    """The runtime was shut down."""
