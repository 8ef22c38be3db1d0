"""The runtime's framing and naming (pure functions, no broker)."""

from __future__ import annotations

import msgspec
import pytest

from dynamo.runtime import naming, wire


class Item(msgspec.Struct):
    text: str
    n: int = 0


def test_request_envelope_round_trip_keeps_payload_raw() -> None:
    data = wire.encode_request("req-1", Item("hello", 3))
    request_id, raw = wire.decode_request(data)
    assert request_id == "req-1"
    assert msgspec.msgpack.decode(raw, type=Item) == Item("hello", 3)


def test_data_batch_end_error_frames() -> None:
    one = wire.encode(Item("a"))
    seq, kind, body = wire.decode_frame(wire.encode_data(7, one))
    assert (seq, kind) == (7, wire.FrameKind.DATA)
    assert wire.decoder_for(Item).decode(body) == Item("a")

    items = [wire.encode(Item(str(i), i)) for i in range(3)]
    seq, kind, body = wire.decode_frame(wire.encode_batch(8, items))
    assert (seq, kind) == (8, wire.FrameKind.BATCH)
    assert [wire.decoder_for(Item).decode(raw) for raw in wire.decode_batch(body)] == [
        Item(str(i), i) for i in range(3)
    ]
    # The whole body at once, as the client decodes it: the same items, typed or not.
    assert wire.batch_decoder_for(Item).decode(body) == [Item(str(i), i) for i in range(3)]
    assert wire.batch_decoder_for(None).decode(body) == [{"text": str(i), "n": i} for i in range(3)]
    with pytest.raises(msgspec.ValidationError):
        wire.batch_decoder_for(Item).decode(wire.encode([{"n": 1}]))

    assert wire.decode_frame(wire.encode_end(9))[:2] == (9, wire.FrameKind.END)
    seq, kind, body = wire.decode_frame(wire.encode_error(10, "ValueError", "bad"))
    assert kind is wire.FrameKind.ERROR and wire.decode_error(body) == ("ValueError", "bad")


@pytest.mark.parametrize(
    "kind", [wire.ErrorKind.SHUTDOWN, wire.ErrorKind.OVERLOADED, wire.ErrorKind.INVALID_REQUEST]
)
def test_error_kinds_travel_as_reserved_types(kind: wire.ErrorKind) -> None:
    """The frame's shape is unchanged: a client that predates a kind decodes it too."""
    _, _, body = wire.decode_frame(wire.encode_kind_error(3, kind, "why"))
    error_type, message = wire.decode_error(body)
    assert (error_type, message) == (kind.value, "why")
    assert wire.error_kind(error_type) is kind


def test_a_class_name_is_an_internal_error() -> None:
    assert wire.error_kind("ValueError") is wire.ErrorKind.INTERNAL
    with pytest.raises(ValueError):
        wire.encode_kind_error(0, wire.ErrorKind.INTERNAL, "no reserved name")


def test_large_bursts_are_split_under_the_frame_limit() -> None:
    big = wire.encode(b"x" * 100_000)
    frames = wire.pack_frames(0, [big] * 12)
    assert len(frames) >= 3
    assert all(len(f) <= wire.MAX_FRAME_BYTES + 1024 for f in frames)
    seqs = [wire.decode_frame(f)[0] for f in frames]
    assert seqs == list(range(len(frames)))
    total = 0
    for frame in frames:
        _, kind, body = wire.decode_frame(frame)
        total += 1 if kind is wire.FrameKind.DATA else len(wire.decode_batch(body))
    assert total == 12
    assert wire.decode_frame(wire.pack_frames(5, [big])[0])[1] is wire.FrameKind.DATA


def test_instance_record_and_control_round_trip() -> None:
    info = wire.InstanceInfo(
        "ns", "comp", "ep", 0xABC, "dyn.ns.comp.ep.0000000000000abc", metadata={"k": 1}
    )
    back = wire.decode_instance(wire.encode_instance(info))
    assert back == info and back.status is wire.InstanceStatus.READY
    assert wire.decode_control(wire.encode_control("_INBOX.x.1", wire.ControlAction.STOP)) == (
        "_INBOX.x.1",
        wire.ControlAction.STOP,
    )


def test_unknown_fields_in_instance_records_are_ignored() -> None:
    raw = msgspec.msgpack.encode(
        {
            "namespace": "a",
            "component": "b",
            "endpoint": "c",
            "instance_id": 1,
            "subject": "s",
            "future": [1, 2],
        }
    )
    assert wire.decode_instance(raw).instance_id == 1


def test_names_are_validated_and_subjects_agree() -> None:
    assert naming.check_name("namespace", "dyn-amo_1") == "dyn-amo_1"
    for bad in ("a.b", "a b", "", "a*", "a>"):
        with pytest.raises(ValueError):
            naming.check_name("namespace", bad)
    key = naming.instance_key("ns", "c", "e", 255)
    assert key == "ns.c.e.00000000000000ff"
    assert naming.request_subject("ns", "c", "e", 255) == "dyn." + key
    assert naming.instance_key_filter("ns", "c", "e") == "ns.c.e.*"
    assert naming.control_subject(255) == "dyn._ctl.00000000000000ff"
