"""The runtime's own framing: request envelopes, response frames, control messages and
instance records. Payloads inside are opaque here (the LLM layer defines them in
`dynamo.llm.protocols`); they are embedded as already-encoded msgpack (`msgspec.Raw`),
so nothing is encoded twice.

Response stream, one NATS message per frame, published to the request's reply inbox:

    [seq, ACCEPTED, nil]           the worker took the request (frame 0, sent at once)
    [seq, DATA,  payload]          one response item
    [seq, BATCH, [payload, ...]]   several items that were ready at once
    [seq, END,   nil]              the handler finished
    [seq, ERROR, [type, message]]  the request failed (terminal)

Frames of several streams bound for one process's inbox in the same event-loop turn
travel together as one MUX message on `<inbox prefix>mux` (see `coalesce`):

    [[token, frame], ...]          each frame as above, for the stream `<prefix><token>`

`seq` counts frames from 0 so a receiver detects a lost frame. An ERROR frame's `type` is
the handler's exception class name, or one of the reserved names of `ErrorKind` that tell
the caller what it may do next (send the request elsewhere, or report the client's error).
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec


class FrameKind(enum.IntEnum):
    DATA = 0
    BATCH = 1
    END = 2
    ERROR = 3
    ACCEPTED = 4  # the request reached its handler: a request lost on its way never gets it


class ControlAction(enum.IntEnum):
    STOP = 0  # the client went away: stop generating, close the handler


class InstanceStatus(str, enum.Enum):
    READY = "ready"  # routable
    DRAINING = "draining"  # alive, finishing in-flight work, takes no new requests


class InstanceInfo(msgspec.Struct, omit_defaults=True):
    """The value of an instance key in the discovery bucket."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    subject: str
    status: InstanceStatus = InstanceStatus.READY
    hostname: str = ""
    # The address other hosts reach this process at (`--advertise-host`); empty when the
    # process did not say (peers then have only `hostname`, which may not resolve there).
    address: str = ""
    pid: int = 0
    started_at: float = msgspec.field(default_factory=time.time)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_frame_decoder = msgspec.msgpack.Decoder(tuple[int, FrameKind, msgspec.Raw])
_batch_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_error_decoder = msgspec.msgpack.Decoder(tuple[str, str])
_control_decoder = msgspec.msgpack.Decoder(tuple[str, ControlAction])
_instance_decoder = msgspec.msgpack.Decoder(InstanceInfo)
_mux_decoder = msgspec.msgpack.Decoder(list[tuple[str, msgspec.Raw]])


def encode(obj: Any) -> bytes:
    """msgpack-encode any payload (msgspec Structs, builtins)."""
    return _encoder.encode(obj)


def encode_request(request_id: str, payload: Any) -> bytes:
    return _encoder.encode((request_id, payload))


def decode_request(data: bytes) -> tuple[str, msgspec.Raw]:
    return _request_decoder.decode(data)


def encode_data(seq: int, item: bytes) -> bytes:
    return _encoder.encode((seq, FrameKind.DATA, msgspec.Raw(item)))


def encode_batch(seq: int, items: list[bytes]) -> bytes:
    return _encoder.encode((seq, FrameKind.BATCH, [msgspec.Raw(i) for i in items]))


MAX_FRAME_BYTES = 512 * 1024
"""Largest BATCH frame the server builds (NATS' default max payload is 1 MiB)."""


def pack_frames(seq: int, items: list[bytes], max_bytes: int = MAX_FRAME_BYTES) -> list[bytes]:
    """Frames carrying encoded `items` from sequence number `seq` on: one DATA frame for a
    single item, BATCH frames otherwise, split so none exceeds `max_bytes` (an item larger
    than that travels alone)."""
    if len(items) == 1:
        return [encode_data(seq, items[0])]
    frames: list[bytes] = []
    group: list[bytes] = []
    size = 0
    for item in items:
        if group and size + len(item) > max_bytes:
            frames.append(_pack_group(seq + len(frames), group))
            group, size = [], 0
        group.append(item)
        size += len(item)
    if group:
        frames.append(_pack_group(seq + len(frames), group))
    return frames


def _pack_group(seq: int, group: list[bytes]) -> bytes:
    return encode_data(seq, group[0]) if len(group) == 1 else encode_batch(seq, group)


def encode_end(seq: int) -> bytes:
    return _encoder.encode((seq, FrameKind.END, None))


def encode_accepted(seq: int) -> bytes:
    return _encoder.encode((seq, FrameKind.ACCEPTED, None))


class ErrorKind(str, enum.Enum):
    """What a failed request means to its caller.

    The kind travels as the `type` of the ERROR frame (the reserved names below, which no
    exception class name collides with in practice), so the frame's shape is the same for
    every error and a client that predates a kind still sees an ordinary remote error.
    """

    INTERNAL = "internal"
    """The handler failed (any other `type`: the exception's class name)."""
    SHUTDOWN = "WorkerShutdown"
    """The worker abandoned the request because it is shutting down (its drain time ran
    out): it did not fail, its worker went away, so it may be placed or migrated
    elsewhere exactly as when a worker dies."""
    OVERLOADED = "WorkerOverloaded"
    """The worker refused the request before running any of it (it serves its bound of
    requests already): sending it to another instance is safe."""
    INVALID_REQUEST = "InvalidRequest"
    """The request itself is at fault (parameters the engine refuses): the client's
    error, which no other instance would accept either."""


_KINDS_BY_TYPE = {kind.value: kind for kind in ErrorKind if kind is not ErrorKind.INTERNAL}


def error_kind(error_type: str) -> ErrorKind:
    """The kind an ERROR frame's `type` stands for (`INTERNAL` for a class name)."""
    return _KINDS_BY_TYPE.get(error_type, ErrorKind.INTERNAL)


def encode_error(seq: int, error_type: str, message: str) -> bytes:
    return _encoder.encode((seq, FrameKind.ERROR, (error_type, message)))


def encode_kind_error(seq: int, kind: ErrorKind, message: str) -> bytes:
    """An ERROR frame of a reserved kind (not `INTERNAL`, which has no reserved name)."""
    if kind is ErrorKind.INTERNAL:
        raise ValueError("an internal error is sent with its exception's class name")
    return encode_error(seq, kind.value, message)


def decode_frame(data: bytes) -> tuple[int, FrameKind, msgspec.Raw]:
    return _frame_decoder.decode(data)


def decode_batch(body: msgspec.Raw) -> list[msgspec.Raw]:
    return _batch_decoder.decode(body)


def decode_error(body: msgspec.Raw) -> tuple[str, str]:
    return _error_decoder.decode(body)


MUX_OVERHEAD_BYTES = 16
"""Upper bound on what a MUX message adds per frame beyond the frame and its token
(msgpack array and string headers), for sizing messages under the server's limit."""


def encode_mux(frames: list[tuple[str, bytes]]) -> bytes:
    """One MUX message carrying `(token, frame)` pairs, in order."""
    return _encoder.encode([(token, msgspec.Raw(frame)) for token, frame in frames])


def decode_mux(data: bytes) -> list[tuple[str, msgspec.Raw]]:
    return _mux_decoder.decode(data)


def encode_control(reply_subject: str, action: ControlAction) -> bytes:
    return _encoder.encode((reply_subject, action))


def decode_control(data: bytes) -> tuple[str, ControlAction]:
    return _control_decoder.decode(data)


def encode_instance(info: InstanceInfo) -> bytes:
    return _encoder.encode(info)


def decode_instance(data: bytes) -> InstanceInfo:
    return _instance_decoder.decode(data)


_typed_batch_decoders: dict[Any, msgspec.msgpack.Decoder] = {}
_typed_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def batch_decoder_for(type_: Any) -> msgspec.msgpack.Decoder:
    """A cached decoder of a BATCH frame's body straight into a list of `type_` (None =
    plain builtins): one C call for the whole batch, where `decode_batch` and then one
    decode per item would parse every item twice."""
    decoder = _typed_batch_decoders.get(type_)
    if decoder is None:
        item = Any if type_ is None else type_
        decoder = _typed_batch_decoders[type_] = msgspec.msgpack.Decoder(list[item])
    return decoder


def decoder_for(type_: Any) -> msgspec.msgpack.Decoder:
    """A cached msgpack decoder for `type_` (None = plain builtins)."""
    decoder = _typed_decoders.get(type_)
    if decoder is None:
        decoder = msgspec.msgpack.Decoder(type_) if type_ is not None else msgspec.msgpack.Decoder()
        _typed_decoders[type_] = decoder
    return decoder
