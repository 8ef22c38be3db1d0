"""The ZMQ relay against real sockets speaking vLLM's PUB + ROUTER replay protocol."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.indexer import KvIndexer
from dynamo.llm.kv_router.vllm_events import KvEventConverter
from dynamo.llm.kv_router.zmq_relay import (
    END_OF_REPLAY,
    EventCallback,
    KvEventRelay,
    connect_address,
    publisher_binds,
)
from dynamo.llm.protocols import KvAllCleared, KvBlockStored, RouterEvent
from dynamo.runtime.ports import free_port
from dynamo.testing.waiting import wait_until_async

B = 4
WORKER = 3
POLL_S = 0.01
RELAY_TIMEOUT_S = 5.0  # for batches published on loopback to be through the relay


def chain_batch(i: int) -> bytes:
    """Batch i stores block i of one long sequence, parented on block i-1, so a batch
    lost or applied out of order leaves an orphan the converter cannot hash."""
    event = {
        "type": "BlockStored",
        "block_hashes": [1000 + i],
        "parent_block_hash": 1000 + i - 1 if i else None,
        "token_ids": list(range(i * B, (i + 1) * B)),
        "block_size": B,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgspec.msgpack.encode([float(i), [event], 0])


def chain_tokens(n: int) -> list[int]:
    return list(range(n * B))


class FakeVllmPublisher:
    """PUB + ROUTER with vLLM's framing and replay answers, where the test decides which
    batches go out live and which stay in the replay buffer."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.buffer: deque[tuple[int, bytes]] = deque()
        self.replay_requests: list[int] = []
        self.answer_replays = True
        self._task = asyncio.create_task(self._serve_replay())

    async def publish(
        self, seq: int, payload: bytes, *, live: bool = True, keep: bool = True
    ) -> None:
        if keep:
            self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def _serve_replay(self) -> None:
        while True:
            client, _empty, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            if not self.answer_replays:
                continue
            for seq, payload in self.buffer:
                if seq >= start_seq:
                    await self.router.send_multipart(
                        [client, b"", b"", seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([client, b"", b"", END_OF_REPLAY, b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close()
        self.router.close()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@pytest.fixture
async def publisher(ctx: zmq.asyncio.Context) -> AsyncIterator[FakeVllmPublisher]:
    pub = FakeVllmPublisher(ctx)
    yield pub
    await pub.close()


async def relay_reaches(relay: KvEventRelay, next_seq: int) -> None:
    """Until the relay has taken every batch before `next_seq`."""
    await wait_until_async(
        lambda: relay.next_seq == next_seq,
        timeout=RELAY_TIMEOUT_S,
        interval=POLL_S,
        what=f"the relay to reach seq {next_seq} (at {relay.next_seq})",
    )


def collector(received: list[RouterEvent], batches: list[int] | None = None) -> EventCallback:
    """A relay callback that appends every event to `received` (and the size of each
    delivery to `batches`)."""

    async def collect(events: Sequence[RouterEvent]) -> None:
        received.extend(events)
        if batches is not None:
            batches.append(len(events))

    return collect


async def publish_until_subscribed(
    publisher: FakeVllmPublisher, relay: KvEventRelay, seq: int, payload: bytes
) -> None:
    """PUB drops what it sends before the subscription arrives: re-send batch `seq` live
    until the relay has taken it (repeats are skipped as duplicates, which this also
    exercises)."""
    while relay.next_seq <= seq:
        await publisher.publish(seq, payload, keep=False)
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running_relay(
    publisher: FakeVllmPublisher, *, replay: bool = True, batch_0: bool = True, **options: Any
) -> AsyncIterator[tuple[KvEventRelay, list[RouterEvent]]]:
    """A relay of `publisher` (its replay endpoint unless not `replay`; `options` beside a
    0.5 s replay timeout) that has relayed batch 0 unless not `batch_0`, and the events it
    has passed on so far; stopped when the block ends."""
    received: list[RouterEvent] = []
    relay = KvEventRelay(
        publisher.endpoint,
        KvEventConverter(WORKER, B),
        collector(received),
        replay_endpoint=publisher.replay_endpoint if replay else None,
        **{"replay_timeout_s": 0.5, **options},
    )
    await relay.start()
    try:
        if batch_0:
            payload = chain_batch(0)
            publisher.buffer.append((0, payload))
            await publish_until_subscribed(publisher, relay, 0, payload)
        yield relay, received
    finally:
        await relay.stop()


def index_of(events: list[RouterEvent]) -> KvIndexer:
    index = KvIndexer(B)
    for event in events:
        index.apply(event)
    return index


async def test_relay_announces_a_clear_first(publisher: FakeVllmPublisher) -> None:
    async with running_relay(publisher) as (_, received):
        assert isinstance(received[0].data, KvAllCleared)
        assert (received[0].worker_id, received[0].event_id) == (WORKER, 0)
        assert received[1].data == KvBlockStored(
            block_hashes=compute_block_hashes(chain_tokens(1), B)
        )


async def test_gap_is_filled_from_the_replay_endpoint(publisher: FakeVllmPublisher) -> None:
    async with running_relay(publisher) as (relay, received):
        await publisher.publish(1, chain_batch(1))
        await publisher.publish(2, chain_batch(2), live=False)  # lost on the way
        await publisher.publish(3, chain_batch(3), live=False)
        await publisher.publish(4, chain_batch(4))
        await relay_reaches(relay, 5)
        await publisher.publish(5, chain_batch(5))
        await relay_reaches(relay, 6)
    assert publisher.replay_requests == [2]
    assert relay.stats.gaps == 1
    assert relay.stats.replayed_batches == 3  # 2, 3 and the 4 that revealed the gap
    assert relay.stats.resyncs == 0
    stored = [e for e in received if isinstance(e.data, KvBlockStored)]
    assert len(stored) == 6, "every batch applied exactly once"
    assert [e.event_id for e in received] == list(range(7))
    # All six blocks are chained correctly: nothing was an orphan.
    assert index_of(received).find_matches_for_tokens(chain_tokens(6)).scores == {WORKER: 6}
    assert relay.converter.stats.dropped_orphan == 0


async def test_missed_start_is_replayed_from_seq_zero(publisher: FakeVllmPublisher) -> None:
    for seq in range(3):  # published before anyone subscribed
        await publisher.publish(seq, chain_batch(seq), live=False)
    async with running_relay(publisher, batch_0=False, replay_timeout_s=2.0) as (relay, received):
        payload = chain_batch(3)
        publisher.buffer.append((3, payload))
        await publish_until_subscribed(publisher, relay, 3, payload)
    assert publisher.replay_requests == [0]
    assert index_of(received).find_matches_for_tokens(chain_tokens(4)).scores == {WORKER: 4}


async def test_unfillable_gap_resynchronises_with_a_clear(publisher: FakeVllmPublisher) -> None:
    async with running_relay(publisher) as (relay, received):
        await publisher.publish(1, chain_batch(1), live=False, keep=False)  # gone for good
        await publisher.publish(2, chain_batch(2))
        await relay_reaches(relay, 3)
    assert relay.stats.resyncs == 1
    kinds = [type(e.data).__name__ for e in received]
    assert kinds == ["KvAllCleared", "KvBlockStored", "KvAllCleared"]
    # Block 2's parent was lost with batch 1, so it is dropped rather than mis-keyed.
    assert relay.converter.stats.dropped_orphan == 1
    assert index_of(received).find_matches_for_tokens(chain_tokens(3)).scores == {}


async def test_silent_replay_endpoint_times_out_and_resyncs(publisher: FakeVllmPublisher) -> None:
    async with running_relay(publisher) as (relay, _):
        publisher.answer_replays = False
        await publisher.publish(1, chain_batch(1), live=False)
        await publisher.publish(2, chain_batch(2))
        await relay_reaches(relay, 3)
    assert publisher.replay_requests == [1]
    assert relay.stats.resyncs == 1


async def test_without_replay_endpoint_a_gap_resyncs(publisher: FakeVllmPublisher) -> None:
    async with running_relay(publisher, replay=False) as (relay, _):
        await publisher.publish(2, chain_batch(2))
        await relay_reaches(relay, 3)
    assert (relay.stats.gaps, relay.stats.resyncs) == (1, 1)
    assert publisher.replay_requests == []


async def test_a_lost_last_batch_is_fetched_when_the_stream_goes_quiet(
    publisher: FakeVllmPublisher,
) -> None:
    """No later batch reveals the gap (the engine went idle): the idle probe finds it."""
    async with running_relay(publisher, batch_0=False, idle_probe_s=0.1, replay_timeout_s=2.0) as (
        relay,
        received,
    ):
        for seq in range(3):  # never seen live: dropped as by a slow-joining subscriber
            await publisher.publish(seq, chain_batch(seq), live=False)
        await relay_reaches(relay, 3)
    assert relay.stats.probes >= 1 and relay.stats.resyncs == 0
    assert index_of(received).find_matches_for_tokens(chain_tokens(3)).scores == {WORKER: 3}


async def test_announced_clear_reaches_routers_without_an_engine_step(
    publisher: FakeVllmPublisher,
) -> None:
    """vLLM holds its own AllBlocksCleared until the next step; the worker announces the
    reset at once, in sequence with the events around it."""
    async with running_relay(publisher) as (relay, received):
        await relay.announce_cleared()
        # After a reset the engine stores from scratch again: block 0 (no parent).
        await publisher.publish(1, chain_batch(0))
        await relay_reaches(relay, 2)
    kinds = [type(e.data).__name__ for e in received]
    assert kinds == ["KvAllCleared", "KvBlockStored", "KvAllCleared", "KvBlockStored"]
    assert [e.event_id for e in received] == [0, 1, 2, 3]
    assert index_of(received).find_matches_for_tokens(chain_tokens(2)).scores == {WORKER: 1}


async def test_bad_messages_and_callback_failures_do_not_stop_the_relay(
    publisher: FakeVllmPublisher,
) -> None:
    async with running_relay(publisher) as (relay, _):
        await publisher.pub.send_multipart([b"", b"short"])  # wrong framing
        await publisher.publish(1, b"\xc1")  # not msgpack
        await publisher.publish(2, chain_batch(2))
        await relay_reaches(relay, 3)
    assert relay.stats.malformed == 2
    assert relay.stats.batches == 2  # batch 0 and batch 2 decoded


async def test_callback_failure_is_counted(publisher: FakeVllmPublisher) -> None:
    calls = 0

    async def flaky(events: Sequence[RouterEvent]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("broker down")

    relay = KvEventRelay(publisher.endpoint, KvEventConverter(WORKER, B), flaky)
    await relay.start()
    try:
        await publish_until_subscribed(publisher, relay, 0, chain_batch(0))
        await publisher.publish(1, chain_batch(1))
        await relay_reaches(relay, 2)
    finally:
        await relay.stop()
    assert (relay.stats.callback_errors, relay.stats.events_out) == (1, 2)


def test_connect_address_for_a_bind_endpoint() -> None:
    assert connect_address("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert connect_address("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert connect_address("tcp://[::]:5557") == "tcp://[::1]:5557"
    assert connect_address("ipc:///tmp/x") == "ipc:///tmp/x"
    # A named host is dialled as configured (e.g. a replay socket bound on one interface).
    assert connect_address("tcp://10.0.0.5:5558") == "tcp://10.0.0.5:5558"


def test_which_side_binds_follows_vllms_rule() -> None:
    for bound in ("tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/x", "inproc://x"):
        assert publisher_binds(bound), bound
    for connected in ("tcp://127.0.0.1:5557", "tcp://10.0.0.5:5557", "tcp://0.0.0.0:5557"):
        assert not publisher_binds(connected), connected


async def test_vllms_publisher_connecting_to_a_named_host_reaches_a_listening_relay() -> None:
    """`tcp://127.0.0.1:PORT` in a user's --kv-events-config: vLLM's publisher *connects*
    there, so the relay must listen (a relay dialling it too would receive nothing)."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    port, replay_port = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    assert not publisher_binds(endpoint)
    received: list[RouterEvent] = []
    relay = KvEventRelay(
        endpoint,
        KvEventConverter(WORKER, B),
        collector(received),
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        listen=True,
        idle_probe_s=60,  # only the live stream (and the gap fills it triggers) counts
    )
    await relay.start()
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=endpoint,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
    )
    try:
        i = 0
        deadline = time.monotonic() + 10
        while relay.stats.batches == relay.stats.replayed_batches and time.monotonic() < deadline:
            publisher.publish(vllm_chain_batch(kv_events, i))
            i += 1
            await asyncio.sleep(0.05)
        await relay_reaches(relay, i)
    finally:
        publisher.shutdown()
        await relay.stop()
    assert relay.stats.resyncs == 0
    live = relay.stats.batches - relay.stats.replayed_batches
    assert live > 0, "the live stream reached the relay (not only replays of idle probes)"
    assert index_of(received).find_matches_for_tokens(chain_tokens(i)).scores == {WORKER: i}


def vllm_chain_batch(kv_events, i: int) -> object:
    """Batch i of one long sequence, as vLLM's own event types."""
    return kv_events.KVEventBatch(
        ts=float(i),
        events=[
            kv_events.BlockStored(
                block_hashes=[bytes([i + 1]) * 32],
                parent_block_hash=bytes([i]) * 32 if i else None,
                token_ids=list(range(i * B, (i + 1) * B)),
                block_size=B,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            )
        ],
    )


async def test_against_vllms_own_publisher(tmp_path: Path) -> None:
    """vLLM's ZmqEventPublisher (no engine needed): batches published before the relay
    subscribed are recovered through vLLM's replay socket."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
    )

    def batch(i: int) -> object:
        return vllm_chain_batch(kv_events, i)

    received: list[RouterEvent] = []
    try:
        for i in range(5):  # nobody subscribed yet: PUB drops these
            publisher.publish(batch(i))
        # publish() only queues; wait until vLLM's thread has sent (and buffered) them all.
        await asyncio.wait_for(asyncio.to_thread(publisher._event_queue.join), 10)
        relay = KvEventRelay(
            f"ipc://{tmp_path}/pub",
            KvEventConverter(WORKER, B),
            collector(received),
            replay_endpoint=f"ipc://{tmp_path}/replay",
        )
        await relay.start()
        try:
            i = 5
            deadline = time.monotonic() + 10
            while relay.next_seq == 0 and time.monotonic() < deadline:
                publisher.publish(batch(i))
                i += 1
                await asyncio.sleep(0.05)
            await relay_reaches(relay, i)
        finally:
            await relay.stop()
    finally:
        publisher.shutdown()
    assert relay.stats.gaps >= 1 and relay.stats.resyncs == 0
    assert index_of(received).find_matches_for_tokens(chain_tokens(i)).scores == {WORKER: i}


async def test_quiet_probes_back_off_and_a_live_message_resets_them(
    publisher: FakeVllmPublisher,
) -> None:
    """An idle engine is probed ever less often (0.1, 0.2, 0.4, then every 0.8 s here), and
    as often as at first again once it publishes."""
    relay = KvEventRelay(
        publisher.endpoint,
        KvEventConverter(WORKER, B),
        collector([]),
        replay_endpoint=publisher.replay_endpoint,
        idle_probe_s=0.1,
        max_idle_probe_s=0.8,
    )
    await relay.start()
    try:
        assert relay.next_probe_s == 0.1
        await wait_until_async(
            lambda: relay.stats.probes >= 4, timeout=RELAY_TIMEOUT_S, what="four quiet probes"
        )
        assert relay.next_probe_s == 0.8, "doubled after each quiet probe, capped"
        await publish_until_subscribed(publisher, relay, 0, chain_batch(0))
        assert relay.next_probe_s is not None and relay.next_probe_s < 0.8, "reset by the batch"
    finally:
        await relay.stop()


def roots_batch(seq: int, roots: int) -> bytes:
    """Batch `seq` stores the first block of `roots` unrelated sequences (as a step in
    which several requests fill a block each)."""
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [5000 + 10 * seq + r],
            "parent_block_hash": None,
            "token_ids": [900 + 10 * seq + r] * B,
            "block_size": B,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        for r in range(roots)
    ]
    return msgspec.msgpack.encode([float(seq), events, 0])


async def test_the_events_of_one_batch_are_handed_over_together(
    publisher: FakeVllmPublisher,
) -> None:
    """One engine step's events reach the publisher in one call: one NATS message and
    one JetStream ack for the step, not one per event."""
    received: list[RouterEvent] = []
    batches: list[int] = []
    relay = KvEventRelay(
        publisher.endpoint,
        KvEventConverter(WORKER, B),
        collector(received, batches),
        replay_endpoint=publisher.replay_endpoint,
        replay_timeout_s=0.5,
    )
    await relay.start()
    try:
        await publish_until_subscribed(publisher, relay, 0, roots_batch(0, 1))
        await publisher.publish(1, roots_batch(1, 3))
        await relay_reaches(relay, 2)
    finally:
        await relay.stop()
    assert batches[-1] == 3, batches
    assert relay.stats.events_out == len(received) == sum(batches)
