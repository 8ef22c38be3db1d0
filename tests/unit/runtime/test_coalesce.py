"""How `ReplyCoalescer` packs the frames of one turn into NATS messages (no NATS here:
`pack_messages` is the pure part; the integration test runs it against nats-server)."""

from __future__ import annotations

from dynamo.runtime import naming, wire
from dynamo.runtime.coalesce import (
    STREAM_HIGH_WATER_BYTES,
    ReplyCoalescer,
    ReplyStream,
    pack_messages,
)

PREFIX = naming.inbox_prefix("abc")


def frame(seq: int, size: int = 10) -> bytes:
    return wire.encode_data(seq, wire.encode("x" * size))


def unpack(subject: str, payload: bytes) -> list[tuple[str, bytes]]:
    """(reply subject, frame) pairs a receiving inbox would hand to its streams."""
    if subject == PREFIX + naming.MUX_TOKEN:
        return [(PREFIX + token, bytes(raw)) for token, raw in wire.decode_mux(payload)]
    return [(subject, payload)]


def test_frames_of_one_inbox_share_one_message_in_order() -> None:
    entries = [(PREFIX + token, frame(seq), None) for seq, token in enumerate("1a1b2a")]
    messages = pack_messages(PREFIX, entries, limit=1024 * 1024)
    assert len(messages) == 1
    subject, payload, carried = messages[0]
    assert subject == PREFIX + naming.MUX_TOKEN
    assert carried == entries
    assert unpack(subject, payload) == [(reply, data) for reply, data, _ in entries]


def test_a_lone_frame_goes_to_its_reply_subject_unwrapped() -> None:
    entry = (PREFIX + "7", frame(0), None)
    assert pack_messages(PREFIX, [entry], limit=1024) == [(entry[0], entry[1], [entry])]


def test_messages_stay_under_the_limit_and_a_huge_frame_goes_alone() -> None:
    limit = 400
    sizes = [50, 50, 50, 50, 900, 50, 50, 50, 50, 50, 50, 50]
    entries = [(PREFIX + format(i, "x"), frame(i, size), None) for i, size in enumerate(sizes)]
    messages = pack_messages(PREFIX, entries, limit)
    assert len(messages) > 2
    delivered = []
    for subject, payload, carried in messages:
        assert len(payload) <= limit or len(carried) == 1, (len(payload), len(carried))
        delivered.extend(unpack(subject, payload))
    assert delivered == [(reply, data) for reply, data, _ in entries]
    huge = next(m for m in messages if len(m[1]) > limit)
    assert huge[0] == entries[4][0]  # alone, unwrapped: it fails alone


def test_a_stream_packs_what_waits_into_numbered_frames_then_its_terminal_frame() -> None:
    coalescer = ReplyCoalescer(nc=None)  # type: ignore[arg-type]  # never publishes here
    stream = ReplyStream(coalescer, PREFIX + "1")
    items = [wire.encode(i) for i in range(3)]
    for item in items:
        stream.push(item)
    stream.push(wire.encode(3))
    frames = stream.take_frames()
    assert len(frames) == 1 and wire.decode_frame(frames[0])[0] == 0  # one BATCH, seq 0
    stream.push(wire.encode(4))
    stream.finish(wire.encode_end)
    frames = stream.take_frames()
    assert [wire.decode_frame(f)[:2] for f in frames] == [
        (1, wire.FrameKind.DATA),
        (2, wire.FrameKind.END),
    ]
    assert stream.take_frames() == []


def test_an_accepted_stream_sends_its_confirmation_as_frame_0_before_any_item() -> None:
    coalescer = ReplyCoalescer(nc=None)  # type: ignore[arg-type]  # never publishes here
    stream = ReplyStream(coalescer, PREFIX + "3")
    stream.accept()
    assert [wire.decode_frame(f)[:2] for f in stream.take_frames()] == [
        (0, wire.FrameKind.ACCEPTED)
    ]
    stream.accept()  # the handler was quick: the confirmation leaves with its first items
    stream.push(wire.encode("a"))
    stream.finish(wire.encode_end)
    assert [wire.decode_frame(f)[:2] for f in stream.take_frames()] == [
        (1, wire.FrameKind.ACCEPTED),
        (2, wire.FrameKind.DATA),
        (3, wire.FrameKind.END),
    ]
    assert stream.items_pushed == 1


def test_a_failed_frame_drops_what_waits_and_says_where_the_client_stopped_hearing() -> None:
    failures: list[bool] = []
    stream = ReplyStream(ReplyCoalescer(nc=None), PREFIX + "2", lambda: failures.append(True))  # type: ignore[arg-type]
    stream.push(wire.encode("a"))
    sent = stream.take_frames()
    stream.push(wire.encode("b"))
    stream.frame_failed(ConnectionError("gone"), sent[0])
    stream.frame_failed(ConnectionError("again"), sent[0])  # only the first counts
    assert failures == [True] and isinstance(stream.error, ConnectionError)
    assert (stream.failed_seq, stream.failed_size) == (0, len(sent[0]))
    stream.push(wire.encode("c"))
    assert stream.take_frames() == []


def test_a_stream_over_its_high_water_mark_holds_its_producer_until_taken() -> None:
    stream = ReplyStream(ReplyCoalescer(nc=None), PREFIX + "3")  # type: ignore[arg-type]
    stream.push(b"x" * STREAM_HIGH_WATER_BYTES)
    assert not stream.space.is_set()
    stream.take_frames()
    assert stream.space.is_set()
