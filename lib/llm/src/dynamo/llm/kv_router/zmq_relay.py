"""Worker-side relay: vLLM's ZMQ KV-event stream in, content-keyed `RouterEvent`s out.

vLLM's ``ZmqEventPublisher`` sends each batch on a PUB socket as three frames,
``[topic, seq, payload]``: ``seq`` is an 8-byte big-endian counter starting at 0 and
``payload`` a msgpack ``EventBatch`` (`vllm_events`). It keeps the last ``buffer_steps``
batches for a ROUTER *replay* socket: a client sends ``[b"", start_seq (8-byte BE)]``
(the empty delimiter a REQ socket would add) and receives every buffered batch with
``seq >= start_seq`` as ``[b"", topic, seq, payload]``, then an end marker
``[b"", b"", -1 as signed 8-byte BE, b""]``. Several replies per request rule out REQ,
so the relay talks to it with a DEALER socket.

PUB/SUB drops messages when the subscriber is slow or not yet connected, so the relay
tracks the next expected ``seq``:

* ``seq`` below it: a duplicate (already applied via replay), skipped;
* ``seq`` above it: a gap; the missing range is fetched from the replay endpoint first,
  so events are always applied in publisher order;
* a gap the replay cannot fill (no replay endpoint, no answer, or the buffer already
  dropped those batches): the relay *resynchronises*: it announces ``AllBlocksCleared``
  and continues from what it has. Forgetting the worker's cache only costs cache hits;
  keeping blocks whose removal was lost would send requests to a cache that is gone.

The relay starts with an ``AllBlocksCleared`` of its own (a restarted worker's engine
has an empty cache, and it tells the indexer a new event sequence starts) and expects
``seq`` 0, so batches published before it connected are replayed.

A gap is only visible when a later batch arrives. The batches a PUB socket drops while
the subscription is still being set up ("slow joiner"), or the last batches before an
engine goes idle, would stay missing until the engine's next step, which may never
come. So after `idle_probe_s` without a live message the relay asks the replay endpoint
for anything from the expected ``seq`` on (an idle engine answers with just the end
marker). Each quiet probe that finds nothing doubles the wait for the next one, up to
`max_idle_probe_s`, and a batch (live or replayed) resets it: a worker idle for an hour
asks a few times a minute, not every second.

Which side listens follows the configured endpoint, as vLLM reads it
(`publisher_binds`): vLLM binds a wildcard (`tcp://*:5557`), IPv6 or ipc endpoint and the
relay dials it (a wildcard host as this host's loopback: the engine core is a child of the
worker, always on this host); a named `tcp://host:port` is one vLLM *connects* to, so the
relay is created with `listen=True` and binds its SUB socket there. The replay socket is
always bound by vLLM and dialled by the relay at its configured host.

Publishing is injected (`on_events`): the worker wires it to NATS; tests collect. It is
handed the events of one batch (one engine step) together, so the worker publishes them
as one JetStream message and waits for one ack, not one per event: at c=16 the requests
of a step fill their blocks in the same step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from dynamo.llm.kv_router.vllm_events import (
    KvEventConverter,
    KvEventDecodeError,
    decode_event_batch,
)
from dynamo.llm.protocols import RouterEvent
from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

EventCallback = Callable[[Sequence[RouterEvent]], Awaitable[None]]
"""Takes the consecutive events of one batch (or a lone clear), in order."""

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame vLLM sends after the last replayed batch."""


@dataclass(slots=True)
class RelayStats:
    """Counters of what the relay saw (for logs, metrics and tests)."""

    batches: int = 0  # batches applied, live or replayed
    events_out: int = 0  # RouterEvents handed to the callback
    duplicates: int = 0  # batches skipped because already applied
    gaps: int = 0  # times a sequence gap was detected
    replayed_batches: int = 0  # batches applied from the replay endpoint
    resyncs: int = 0  # gaps that could not be filled (cache announced cleared)
    malformed: int = 0  # messages or batches that could not be decoded
    callback_errors: int = 0  # batches of events the callback failed to take
    probes: int = 0  # replay requests sent because the live stream was quiet


_WILDCARDS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}
"""Bind-all hosts, and the loopback address a local peer dials instead."""


def publisher_binds(endpoint: str) -> bool:
    """Whether vLLM's `ZmqEventPublisher` binds `endpoint` (and so the relay connects).

    vLLM's own rule (`ZmqEventPublisher._is_bind_endpoint`): a wildcard (`*`), an IPv6
    address (`::` anywhere) and ipc/inproc endpoints are bound; any other `tcp://host:port`
    is *connected to*: the publisher expects a subscriber already bound there."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _split_tcp(endpoint: str) -> tuple[str, str] | None:
    """(host, port) of a `tcp://host:port` endpoint, None for other transports."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return host, port


def connect_address(endpoint: str) -> str:
    """The address a local subscriber dials for an endpoint vLLM binds: a wildcard host
    (`tcp://*:5557`, `tcp://0.0.0.0:5557`, `tcp://[::]:5557`) becomes this host's loopback
    address; a named host (`tcp://10.0.0.5:5557`: a replay socket bound on one interface)
    and ipc/inproc endpoints are dialled as configured."""
    parts = _split_tcp(endpoint)
    if parts is None:
        return endpoint
    host, port = parts
    return f"tcp://{_WILDCARDS.get(host, host)}:{port}"


class KvEventRelay:
    """Subscribes to one engine's KV events and forwards them re-keyed by content."""

    def __init__(
        self,
        endpoint: str,
        converter: KvEventConverter,
        on_events: EventCallback,
        *,
        replay_endpoint: str | None = None,
        listen: bool = False,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        idle_probe_s: float = 1.0,
        max_idle_probe_s: float = 8.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        # `listen`: bind the SUB socket at `endpoint` (the publisher connects to it, as
        # vLLM does for a named `tcp://host:port`, see `publisher_binds`); else dial it.
        self._listen = listen
        self.endpoint = endpoint if listen else connect_address(endpoint)
        self.replay_endpoint = connect_address(replay_endpoint) if replay_endpoint else None
        self.converter = converter
        self.stats = RelayStats()
        self._on_events = on_events
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout_s
        self._first_probe_ms = int(idle_probe_s * 1000) if self.replay_endpoint else None
        self._max_probe_ms = max(int(max_idle_probe_s * 1000), self._first_probe_ms or 0)
        self._idle_probe_ms = self._first_probe_ms
        # Not `Context.instance()`: once a plain zmq context singleton exists in the
        # process (vLLM's publisher makes one), the asyncio subclass would return it.
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._expected_seq = 0
        # A batch's events and an out-of-band clear must not interleave (ids would go
        # backwards and the indexer would drop the rest of the batch as stale).
        self._delivery = asyncio.Lock()

    @property
    def next_probe_s(self) -> float | None:
        """How long the live stream may now stay quiet before the next replay probe
        (None: no replay endpoint, no probes)."""
        return None if self._idle_probe_ms is None else self._idle_probe_ms / 1000

    @property
    def next_seq(self) -> int:
        """The publisher sequence number the relay expects next."""
        return self._expected_seq

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Announce an empty cache, connect, and start forwarding in the background."""
        if self._task is not None:
            raise RuntimeError("relay already started")
        await self._deliver([self.converter.clear()])
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        _allow_ipv6(sub, self.endpoint)
        if self._listen:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name="kv-event-relay")

    async def stop(self) -> None:
        """Stop forwarding and close the sockets (idempotent)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = None
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    async def announce_cleared(self) -> None:
        """Tell routers the engine's prefix cache was reset, now.

        vLLM queues its own ``AllBlocksCleared`` and publishes it only with the next
        engine step, which an idle engine does not take: without this the routers would
        keep sending requests after a cache that no longer exists. The late vLLM event,
        when it comes, is one more (harmless) clear.
        """
        async with self._delivery:
            await self._deliver([self.converter.clear()])

    async def __aenter__(self) -> KvEventRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ live stream

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            if not await self._sub.poll(self._idle_probe_ms):
                await self._probe()
                continue
            self._idle_probe_ms = self._first_probe_ms
            frames = await self._sub.recv_multipart()
            try:
                await self.handle_message(frames)
            except Exception:  # one bad message must not stop the relay
                log.exception("kv relay: failed to handle a message")

    async def _probe(self) -> None:
        """Quiet for a while: fetch batches the live stream may have dropped."""
        self.stats.probes += 1
        before = self._expected_seq
        try:
            await self._fill_gap(quiet=True)
        except Exception:
            log.exception("kv relay: idle replay probe failed")
        if self._idle_probe_ms is None:
            return
        if self._expected_seq == before:  # nothing missed: ask again later than now
            self._idle_probe_ms = min(2 * self._idle_probe_ms, self._max_probe_ms)
        else:  # batches were missed: the engine is publishing again
            self._idle_probe_ms = self._first_probe_ms

    async def handle_message(self, frames: list[bytes]) -> None:
        """Apply one live ``[topic, seq, payload]`` message, filling a gap first."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            log.warning("kv relay: unexpected message with %d frames", len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        if seq < self._expected_seq:
            self.stats.duplicates += 1
            return
        if seq > self._expected_seq:
            self.stats.gaps += 1
            log.info("kv relay: gap, expected seq %d got %d", self._expected_seq, seq)
            await self._fill_gap()
            if seq < self._expected_seq:
                self.stats.duplicates += 1
                return
            if seq > self._expected_seq:
                await self._resync(seq)
        await self._apply(seq, frames[2])

    # ------------------------------------------------------------------ gaps

    async def _fill_gap(self, *, quiet: bool = False) -> None:
        """Replay from the expected seq; applies what the publisher still buffers and
        resynchronises where its buffer has holes. Returns on no answer (logged unless
        `quiet`: an idle probe is not worth a warning every second)."""
        if self.replay_endpoint is None:
            return
        sock = self._replay_socket()
        await sock.send_multipart([b"", self._expected_seq.to_bytes(8, "big")])
        while True:
            if not await sock.poll(int(self._replay_timeout * 1000)):
                log.log(
                    logging.DEBUG if quiet else logging.WARNING,
                    "kv relay: replay endpoint %s did not answer",
                    self.replay_endpoint,
                )
                self._drop_replay_socket()  # a late answer must not leak into the next request
                return
            frames = await sock.recv_multipart()
            if len(frames) != 4 or frames[2] == END_OF_REPLAY:
                return
            seq = int.from_bytes(frames[2], "big")
            if seq < self._expected_seq:
                continue
            if seq > self._expected_seq:
                await self._resync(seq)
            await self._apply(seq, frames[3])
            self.stats.replayed_batches += 1

    async def _resync(self, seq: int) -> None:
        """Batches before `seq` are lost for good: announce an empty cache, go on at `seq`."""
        log.warning("kv relay: batches %d..%d lost, resynchronising", self._expected_seq, seq - 1)
        self.stats.resyncs += 1
        self._expected_seq = seq
        await self._deliver([self.converter.clear()])

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._replay is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            assert self.replay_endpoint is not None
            _allow_ipv6(sock, self.replay_endpoint)
            sock.connect(self.replay_endpoint)
            self._replay = sock
        return self._replay

    def _drop_replay_socket(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    # ------------------------------------------------------------------ delivery

    async def _apply(self, seq: int, payload: bytes) -> None:
        """Decode, convert and deliver one batch; `seq` counts as consumed either way."""
        self._expected_seq = seq + 1
        try:
            batch = decode_event_batch(payload)
        except KvEventDecodeError as exc:
            self.stats.malformed += 1
            log.warning("kv relay: undecodable batch %d: %s", seq, exc)
            return
        self.stats.batches += 1
        events = self.converter.convert_batch(batch)
        if not events:
            return
        async with self._delivery:
            await self._deliver(events)

    async def _deliver(self, events: Sequence[RouterEvent]) -> None:
        """Hand a batch's events to the callback; a failure is counted and logged, not
        fatal (the next batch, or the next resync, still reaches the router)."""
        try:
            await self._on_events(events)
        except Exception:
            self.stats.callback_errors += 1
            log.exception(
                "kv relay: event callback failed for events %d..%d",
                events[0].event_id,
                events[-1].event_id,
            )
            return
        self.stats.events_out += len(events)


def _allow_ipv6(sock: zmq.asyncio.Socket, endpoint: str) -> None:
    """ZMQ sockets speak IPv4 only unless told otherwise; an IPv6 literal needs it."""
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
