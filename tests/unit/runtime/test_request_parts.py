"""Splitting a request over one NATS message into parts, and joining them, with bounds.

The transport (parts published with headers, joined by a real server) is covered by
tests/integration/test_runtime_faults.py; these are the joiner's rules."""

from __future__ import annotations

import pytest

from dynamo.runtime.request_parts import (
    PART_HEADER,
    PART_OVERHEAD_BYTES,
    JoinerFullError,
    PartError,
    RequestJoiner,
    part_headers,
    part_of,
    split,
)
from dynamo.testing.clocks import FakeClock

LIMIT = PART_OVERHEAD_BYTES + 100  # 100 payload bytes a part


def test_parts_fit_the_limit_and_join_to_the_request() -> None:
    payload = bytes(range(256)) * 3
    parts = split(payload, LIMIT)
    assert [len(p) for p in parts] == [100] * 7 + [68]
    joiner = RequestJoiner()
    joined = [joiner.add("inbox.1", i, len(parts), p) for i, p in enumerate(parts)]
    assert joined[:-1] == [None] * 7 and joined[-1] == payload
    assert joiner.bytes_held == 0 and "inbox.1" not in joiner
    assert joiner.requests_joined == 1


def test_two_requests_join_side_by_side() -> None:
    joiner = RequestJoiner()
    assert joiner.add("a", 0, 2, b"a1") is None
    assert joiner.add("b", 0, 2, b"b1") is None
    assert joiner.add("b", 1, 2, b"b2") == b"b1b2"
    assert joiner.add("a", 1, 2, b"a2") == b"a1a2"


def test_the_header_names_index_and_count() -> None:
    assert part_of(part_headers(2, 5)) == (2, 5)
    assert part_of(None) is None and part_of({}) is None and part_of({"other": "x"}) is None
    for bad in ("5/5", "x/2", "1", "-1/2", "1/"):
        with pytest.raises(PartError, match="malformed"):
            part_of({PART_HEADER: bad})


def test_a_lost_part_drops_the_request() -> None:
    joiner = RequestJoiner()
    joiner.add("a", 0, 3, b"x")
    with pytest.raises(PartError, match="a part was lost"):
        joiner.add("a", 2, 3, b"z")
    assert "a" not in joiner and joiner.bytes_held == 0 and joiner.requests_dropped == 1
    with pytest.raises(PartError, match="without the first"):
        joiner.add("b", 1, 3, b"y")


def test_a_request_over_its_bound_is_dropped() -> None:
    joiner = RequestJoiner(max_request_bytes=5)
    joiner.add("a", 0, 3, b"abc")
    with pytest.raises(PartError, match="over 5 bytes"):
        joiner.add("a", 1, 3, b"def")
    assert joiner.bytes_held == 0


def test_joining_beyond_the_servers_bound_is_refused_as_overloaded() -> None:
    joiner = RequestJoiner(max_joining_bytes=8)
    joiner.add("a", 0, 2, b"12345")
    with pytest.raises(JoinerFullError):
        joiner.add("b", 0, 2, b"6789")
    assert "a" in joiner and "b" not in joiner
    assert joiner.add("a", 1, 2, b"678") == b"12345678"


def test_parts_that_stop_coming_expire() -> None:
    clock = FakeClock()
    joiner = RequestJoiner(timeout_s=30, clock=clock)
    joiner.add("a", 0, 2, b"x")
    clock.now += 20
    joiner.add("b", 0, 2, b"y")
    clock.now += 11  # a: 31 s since its last part; b: 11 s
    assert joiner.expire() == 1
    assert "a" not in joiner and "b" in joiner and joiner.bytes_held == 1
