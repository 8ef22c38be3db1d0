"""The bookings of the other KV-router replicas of one endpoint, and what to tell them.

Each frontend's router books the requests it sends (`KvScheduler`): a worker's load is the
blocks its requests in flight hold. With several frontends (`--http-workers N`, or
replicas on other hosts behind a load balancer) each would see only its own share, and a
burst arriving at two replicas at once would go, from both, to the same idle worker.
`ReplicaBooks` is the NATS-free state machine that keeps one replica's books complete:

* **Own changes out.** Every change of the local books (`SequenceBooked`,
  `SequencePrefilled`, `SequenceFreed`) is recorded (`local_change`), and published while
  at least one other replica is known: a lone replica sends heartbeats only, so sync is
  cheap enough to be on by default.
* **Others' changes in.** A remote booking is applied to the scheduler (`BookingLedger`)
  under the key ``<replica id>:<request id>``: a local request id (``cmpl-<hex>``,
  ``chatcmpl-<hex>``, made by the frontend) never contains ``:``, so the two cannot
  collide, and two replicas' equal request ids do not either. Messages from this replica
  itself (NATS echoes them back) are ignored.
* **Liveness: heartbeats.** Every replica beats every `interval_s` with the number of its
  bookings and a fingerprint of their ids (XOR of CRC-32s). A replica unheard of for
  `miss_limit` of its own intervals is dead and its bookings are released: a crashed
  frontend's requests stop weighing on their workers within seconds. Heartbeats were
  chosen over a per-booking expiry because a request may legitimately run for many
  minutes (long generations), so no expiry bound would be both safe and short; a
  graceful shutdown (`ReplicaLeaving`) drops the bookings at once.
* **Repair: snapshots.** Core NATS delivers at most once. Messages of one publisher
  arrive in order, so when a heartbeat arrives every change published before it has been
  applied, and the receiver's count and fingerprint for that replica must equal the
  heartbeat's; if not (a lost message, or a replica met for the first time), the
  receiver asks that replica for a `BookingSnapshot` (at most once per its interval),
  which replaces what it held. A new replica asks every replica for one as it starts
  (`hello`), so it routes with the others' current bookings from its first requests.
* **Peers are not trusted.** Every field is bounded where the wire types are declared
  (`dynamo.llm.protocols`: ids, token counts, hashes, a heartbeat interval of at most a
  minute), so an out-of-bounds message is dropped at decoding. Here: a booking on a worker
  this replica does not know (no card) is not applied and not counted as held, so the next
  heartbeat disagrees and a snapshot brings it once the worker's card arrives, and a
  made-up worker id never becomes a worker in the books; a booking whose overlap exceeds
  its hashes is refused; at most `MAX_PEERS` replicas and `MAX_REMOTE_BOOKINGS` bookings
  per replica are held.
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from dynamo.llm.protocols import (
    MAX_HEARTBEAT_INTERVAL_S,
    MAX_SYNC_HASHES,
    MIN_HEARTBEAT_INTERVAL_S,
    BookingChange,
    BookingChanges,
    BookingSnapshot,
    ReplicaHeartbeat,
    ReplicaLeaving,
    ReplicaSyncData,
    ReplicaSyncMessage,
    SequenceBooked,
    SequenceFreed,
    SequencePrefilled,
    SnapshotRequest,
)

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
"""How often a replica tells the others it lives (and what it holds)."""
DEFAULT_MISS_LIMIT = 3
"""Missed heartbeats after which a replica counts as dead and its bookings are dropped."""
MAX_HASHES_PER_MESSAGE = MAX_SYNC_HASHES
"""Block hashes one message may carry (the wire type's bound, `protocols.MAX_SYNC_HASHES`)."""

MAX_PEERS = 256
"""Other replicas one replica keeps books for; more are ignored (logged once)."""
MAX_REMOTE_BOOKINGS = 1 << 16
"""Bookings held for one other replica (a frontend's in-flight bound is 1024 a model)."""

REMOTE_KEY_SEPARATOR = ":"

ChangeT = TypeVar("ChangeT", bound=BookingChange)


def remote_key(replica_id: str, request_id: str) -> str:
    """The key a remote replica's booking has in the local books."""
    return f"{replica_id}{REMOTE_KEY_SEPARATOR}{request_id}"


def request_fingerprint(request_id: str) -> int:
    """One request id's share of a replica's fingerprint (XORed over its bookings)."""
    return zlib.crc32(request_id.encode())


def hash_chunks(changes: Iterable[ChangeT]) -> list[list[ChangeT]]:
    """`changes` in order, cut into the chunks one message each carries: at most
    `MAX_HASHES_PER_MESSAGE` hashes, a change counting its block hashes plus one (a
    single change over the bound still goes, alone). No changes, no chunks."""
    chunks: list[list[ChangeT]] = []
    hashes = 0
    for change in changes:
        size = 1 + (len(change.block_hashes) if isinstance(change, SequenceBooked) else 0)
        if not chunks or hashes + size > MAX_HASHES_PER_MESSAGE:
            chunks.append([])
            hashes = 0
        chunks[-1].append(change)
        hashes += size
    return chunks


class BookingLedger(Protocol):
    """Where remote bookings are applied: what `KvScheduler` offers for it."""

    def knows_worker(self, worker_id: int) -> bool: ...

    def apply_booking(self, key: str, booking: SequenceBooked) -> bool: ...

    def apply_prefill(self, key: str, num_new_tokens: int = 0) -> bool: ...

    def release(self, request_id: str) -> bool: ...


@dataclass(slots=True)
class SyncStats:
    """Counters for `GET /debug/kv`."""

    changes_in: int = 0  # remote booking changes received
    changes_out: int = 0  # own booking changes handed out for publishing
    snapshots_in: int = 0
    snapshots_out: int = 0
    resyncs: int = 0  # snapshots asked for because a heartbeat disagreed
    rejected: int = 0  # remote bookings the local books could not take
    unknown_worker: int = 0  # remote bookings on a worker this replica has no card of
    peers_ignored: int = 0  # messages of replicas beyond MAX_PEERS
    replicas_expired: int = 0
    replicas_left: int = 0


@dataclass(slots=True)
class _Peer:
    """What this replica holds of another one."""

    last_seen: float
    interval_s: float
    requests: set[str] = field(default_factory=set)
    fingerprint: int = 0
    snapshot_asked_at: float = -math.inf


@dataclass(eq=False)
class ReplicaBooks:
    """One replica's side of the sync: its own bookings and the others', see the module."""

    ledger: BookingLedger
    replica_id: str
    _: KW_ONLY
    interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    miss_limit: int = DEFAULT_MISS_LIMIT
    clock: Callable[[], float] = time.monotonic
    _own: dict[str, SequenceBooked] = field(init=False, default_factory=dict)
    _own_fingerprint: int = field(init=False, default=0)
    _peers: dict[str, _Peer] = field(init=False, default_factory=dict)
    stats: SyncStats = field(init=False, default_factory=SyncStats)

    def __post_init__(self) -> None:
        if not MIN_HEARTBEAT_INTERVAL_S <= self.interval_s <= MAX_HEARTBEAT_INTERVAL_S:
            raise ValueError(
                f"interval_s must be within [{MIN_HEARTBEAT_INTERVAL_S}, "
                f"{MAX_HEARTBEAT_INTERVAL_S}] (the bounds peers accept)"
            )
        if self.miss_limit < 1:
            raise ValueError("miss_limit must be at least 1")
        if REMOTE_KEY_SEPARATOR in self.replica_id:
            raise ValueError(f"a replica id cannot contain {REMOTE_KEY_SEPARATOR!r}")

    # ------------------------------------------------------------------ own books

    def local_change(self, change: BookingChange) -> bool:
        """Record a change of the local books; True when it should be published (it
        concerns an own booking and another replica is listening)."""
        request_id = change.request_id
        if isinstance(change, SequenceBooked):
            if request_id not in self._own:
                self._own_fingerprint ^= request_fingerprint(request_id)
            self._own[request_id] = change
        elif isinstance(change, SequencePrefilled):
            booking = self._own.get(request_id)
            if booking is None:
                return False
            tokens = (booking.first_output_tokens or 0) + change.new_tokens
            self._own[request_id] = msgspec.structs.replace(booking, first_output_tokens=tokens)
        else:
            if self._own.pop(request_id, None) is None:
                return False  # a remote booking's key, released with its worker
            self._own_fingerprint ^= request_fingerprint(request_id)
        if not self._peers:
            return False
        self.stats.changes_out += 1
        return True

    def heartbeat(self) -> ReplicaHeartbeat:
        return ReplicaHeartbeat(self.interval_s, len(self._own), self._own_fingerprint)

    def hello(self) -> SnapshotRequest:
        """What a starting replica sends: every replica's snapshot, please."""
        return SnapshotRequest()

    def snapshot(self) -> list[BookingSnapshot]:
        """Every own booking, in chunks of at most `MAX_HASHES_PER_MESSAGE` hashes."""
        self.stats.snapshots_out += 1
        chunks = hash_chunks(self._own.values()) or [[]]
        return [BookingSnapshot(chunk, replace=index == 0) for index, chunk in enumerate(chunks)]

    # ------------------------------------------------------------------ others' books

    def receive(self, message: ReplicaSyncMessage) -> list[ReplicaSyncData]:
        """Apply another replica's message; returns what to publish in answer (a
        snapshot asked for, or a request for the sender's snapshot)."""
        sender, data = message.replica_id, message.data
        if sender == self.replica_id or REMOTE_KEY_SEPARATOR in sender:
            return []  # our own message echoed back (or a malformed id)
        if isinstance(data, ReplicaLeaving):
            if self.drop_replica(sender):
                self.stats.replicas_left += 1
                log.info("router replica %s left; its bookings are released", sender)
            return []
        now = self.clock()
        peer = self._peers.get(sender)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self.stats.peers_ignored += 1
                if self.stats.peers_ignored == 1:
                    log.warning(
                        "router replica %s ignored: already sharing books with %d replicas",
                        sender, MAX_PEERS,
                    )  # fmt: skip
                return []
            peer = self._peers[sender] = _Peer(last_seen=now, interval_s=self.interval_s)
            log.info("router replica %s joined; sharing bookings with it", sender)
        peer.last_seen = now
        if isinstance(data, BookingChanges):
            for change in data.changes:
                self._apply(sender, peer, change)
            self.stats.changes_in += len(data.changes)
        elif isinstance(data, BookingSnapshot):
            self.stats.snapshots_in += 1
            if data.replace:
                self._release_all(sender, peer)
            for booking in data.bookings:
                self._apply(sender, peer, booking)
        elif isinstance(data, ReplicaHeartbeat):
            peer.interval_s = data.interval_s  # bounded by the wire type
            if (len(peer.requests), peer.fingerprint) != (data.bookings, data.fingerprint):
                if now - peer.snapshot_asked_at >= peer.interval_s:
                    peer.snapshot_asked_at = now
                    self.stats.resyncs += 1
                    return [SnapshotRequest(sender)]
        elif isinstance(data, SnapshotRequest):
            if data.replica_id is None or data.replica_id == self.replica_id:
                return list(self.snapshot())
        return []

    def expire(self) -> list[str]:
        """Drop every replica silent for `miss_limit` of its heartbeat intervals; returns
        their ids."""
        now = self.clock()
        dead = [
            replica_id
            for replica_id, peer in self._peers.items()
            if now - peer.last_seen > self.miss_limit * peer.interval_s
        ]
        for replica_id in dead:
            log.warning(
                "router replica %s missed %d heartbeats; releasing its %d bookings",
                replica_id,
                self.miss_limit,
                len(self._peers[replica_id].requests),
            )
            self.drop_replica(replica_id)
            self.stats.replicas_expired += 1
        return dead

    def drop_replica(self, replica_id: str) -> bool:
        """Release every booking of `replica_id` and forget it; False if unknown."""
        peer = self._peers.pop(replica_id, None)
        if peer is None:
            return False
        self._release_all(replica_id, peer)
        return True

    def replicas(self) -> dict[str, int]:
        """Known other replicas and how many bookings each holds."""
        return {replica_id: len(peer.requests) for replica_id, peer in self._peers.items()}

    def debug_state(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "interval_s": self.interval_s,
            "own_bookings": len(self._own),
            "replicas": self.replicas(),
            **asdict(self.stats),
        }

    # ------------------------------------------------------------------ internals

    def _apply(self, sender: str, peer: _Peer, change: BookingChange) -> None:
        request_id = change.request_id
        key = remote_key(sender, request_id)
        if isinstance(change, SequenceBooked):
            self._apply_booking(sender, peer, change)
        elif isinstance(change, SequencePrefilled):
            if request_id in peer.requests:
                self.ledger.apply_prefill(key, change.new_tokens)
        elif isinstance(change, SequenceFreed) and request_id in peer.requests:
            peer.requests.discard(request_id)
            peer.fingerprint ^= request_fingerprint(request_id)
            self.ledger.release(key)

    def _apply_booking(self, sender: str, peer: _Peer, booking: SequenceBooked) -> None:
        request_id = booking.request_id
        if not self.ledger.knows_worker(booking.worker_id):
            # Not held, so the sender's next heartbeat disagrees and its snapshot brings
            # the booking again, by when the worker's card may have arrived here.
            self.stats.unknown_worker += 1
            return
        fresh = request_id not in peer.requests
        if fresh and len(peer.requests) >= MAX_REMOTE_BOOKINGS:
            self.stats.rejected += 1
            return
        if fresh:
            peer.requests.add(request_id)
            peer.fingerprint ^= request_fingerprint(request_id)
        key = remote_key(sender, request_id)
        consistent = booking.cached_blocks <= booking.overlap_blocks <= len(booking.block_hashes)
        try:
            applied = consistent and self.ledger.apply_booking(key, booking)
        except ValueError as exc:
            applied = False
            log.debug("remote booking %s not applied: %s", key, exc)
        if not applied:
            self.stats.rejected += 1

    def _release_all(self, sender: str, peer: _Peer) -> None:
        for request_id in peer.requests:
            self.ledger.release(remote_key(sender, request_id))
        peer.requests.clear()
        peer.fingerprint = 0
