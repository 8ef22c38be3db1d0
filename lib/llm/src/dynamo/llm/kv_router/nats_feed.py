"""Frontend side of the KV router's NATS plumbing: `create_kv_router`.

A `KvRouter` (NATS-free, `router.py`) is fed by three subscriptions, owned here:

* the workers' KV events, replayed from the start of the JetStream stream
  (`subjects.KV_EVENTS_STREAM`, filtered to the card's namespace/component), so a frontend
  started after the workers rebuilds their caches' index before it routes;
* the workers' load reports (core NATS, `subjects.load_metrics_filter`);
* the endpoint client's set of ready instances: a worker that leaves it has its blocks
  dropped, and `WorkerMembership` keeps its late or replayed events from resurrecting it.

In approximate mode (`CachePrediction(kv_events=False)`, the frontend's `--no-kv-events`)
there is no event subscription: the router predicts caches from its own decisions alone.

With `ReplicaSyncSettings(enabled=True)` (the frontend's default) the router also shares
its bookings of requests in flight with the other routers of the endpoint
(`replica_sync.RouterReplicaSync`).

A broker restarted without its store comes back with an empty stream whose sequence
numbers start again at 1. The subscription notices (`StreamSubscription`, `on_reset`):
the feed then forgets every cached block it learnt (the events that would have told it
of removals during the outage are gone), keeps the workers, their load and their
bookings, and replays the new stream from its start, where every worker re-announces
its whole cache after its own reconnect (`KvEventPublisher.resync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import KW_ONLY, InitVar, asdict, dataclass, field
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError

from dynamo.llm.kv_router.anticipation import CachePrediction
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.membership import DEFAULT_GRACE_S, WorkerMembership
from dynamo.llm.kv_router.publisher import kv_events_stream
from dynamo.llm.kv_router.replica_sync import ReplicaSyncSettings, RouterReplicaSync
from dynamo.llm.kv_router.router import KvRouter, build_kv_router
from dynamo.llm.kv_router.scheduler_defaults import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.llm.kv_router.subjects import (
    instance_of_subject,
    kv_events_filter,
    load_metrics_filter,
    router_sync_subject,
)
from dynamo.llm.kv_router.tiers import TierWeights
from dynamo.llm.protocols import (
    KvAllCleared,
    LoadMetrics,
    ModelCard,
    RouterEvent,
    decode,
    kv_events_of,
)
from dynamo.runtime.client import Client
from dynamo.runtime.events import EventStream, StreamSubscription
from dynamo.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT_S = 10.0
"""Longest `create_kv_router` waits for the replay to catch up before routing anyway."""
SWEEP_INTERVAL_S = 1.0


@dataclass(slots=True)
class FeedStats:
    """Counters of what reached the router (shown by `GET /debug/kv`)."""

    events: int = 0  # applied to the indexer
    events_ignored: int = 0  # from departed workers
    events_malformed: int = 0  # undecodable, or worker id not matching the subject
    load_reports: int = 0
    load_ignored: int = 0
    load_malformed: int = 0
    workers_removed: int = 0
    stream_resets: int = 0  # the stream was found recreated (broker lost its store)
    replay_target_seq: int = 0  # last stream sequence of this component at start
    replay_seconds: float = 0.0
    replay_complete: bool = False


@dataclass(eq=False)
class KvRouterFeed:
    """The NATS subscriptions that keep one `KvRouter` informed."""

    name = "feed"

    runtime: DistributedRuntime
    router: KvRouter
    namespace: InitVar[str]
    component: InitVar[str]
    client: Client
    _: KW_ONLY
    stream: EventStream = field(default_factory=kv_events_stream)
    grace_s: InitVar[float] = DEFAULT_GRACE_S
    kv_events: bool = True
    membership: WorkerMembership = field(init=False)
    stats: FeedStats = field(init=False, default_factory=FeedStats)
    _events_filter: str = field(init=False)
    _load_filter: str = field(init=False)
    _events: StreamSubscription | None = field(init=False, default=None)
    _load_sub: Subscription | None = field(init=False, default=None)
    _sweeper: asyncio.Task[None] | None = field(init=False, default=None)
    _replayed: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    # Workers whose events reached the router.
    _indexed: set[int] = field(init=False, default_factory=set)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self, namespace: str, component: str, grace_s: float) -> None:
        self._events_filter = kv_events_filter(namespace, component)
        self._load_filter = load_metrics_filter(namespace, component)
        self.membership = WorkerMembership(grace_s)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S) -> None:
        """Subscribe everything, then wait (bounded) until the stream's history up to now
        has been applied, so the first routing decisions already see cached prefixes."""
        self.client.add_listener(self._on_instances)
        self._on_instances(self.client.instance_ids())  # live workers' events apply at once
        self._load_sub = await self.runtime.subscribe(self._load_filter, self._on_load)
        self._sweeper = asyncio.create_task(self._sweep(), name="kv-feed-sweep")
        if not self.kv_events:
            self.stats.replay_complete = True
            log.info("kv router: approximate mode, no KV events read (%s)", self._events_filter)
            return
        await self.stream.ensure(self.runtime)
        self.stats.replay_target_seq = await self._last_sequence()
        if self.stats.replay_target_seq == 0:
            self.stats.replay_complete = True
            self._replayed.set()
        started = time.monotonic()
        self._events = await StreamSubscription(
            self.runtime,
            self.stream,
            self._events_filter,
            self._on_event,
            on_reset=self._on_stream_reset,
        ).start()
        try:
            await asyncio.wait_for(self._replayed.wait(), replay_timeout_s)
        except TimeoutError:
            log.warning(
                "kv router: replay of %s not complete after %.0fs (at #%d of #%d); routing anyway",
                self._events_filter,
                replay_timeout_s,
                self._events.last_sequence,
                self.stats.replay_target_seq,
            )
        self.stats.replay_seconds = round(time.monotonic() - started, 3)
        log.info(
            "kv router: replayed %d events of %s in %.2fs",
            self.stats.events,
            self._events_filter,
            self.stats.replay_seconds,
        )

    async def close(self) -> None:
        """Stop every subscription (the client's listener then ignores changes)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._events is not None:
            await self._events.close()
            self._events = None
        if self._load_sub is not None:
            with contextlib.suppress(Exception):
                await self._load_sub.unsubscribe()
            self._load_sub = None

    def debug_state(self) -> dict[str, Any]:
        state = asdict(self.stats)
        state["kv_events"] = self.kv_events
        state["events_filter"] = self._events_filter
        state["last_sequence"] = self._events.last_sequence if self._events else None
        state["live_workers"] = [f"{w:016x}" for w in sorted(self.membership.live)]
        return state

    # ------------------------------------------------------------------ handlers

    async def _on_event(self, subject: str, payload: bytes, sequence: int) -> None:
        if sequence >= self.stats.replay_target_seq and not self._replayed.is_set():
            self.stats.replay_complete = True
            self._replayed.set()
        try:
            events = kv_events_of(payload)
        except msgspec.MsgspecError as exc:
            self.stats.events_malformed += 1
            log.warning("kv router: undecodable event #%d on %s: %s", sequence, subject, exc)
            return
        worker_id = instance_of_subject(subject)
        for event in events:
            if event.worker_id != worker_id:
                self.stats.events_malformed += 1
                log.warning("kv router: event of worker %x on %s dropped", event.worker_id, subject)
                continue
            if not self.membership.accepts(event.worker_id):
                self.stats.events_ignored += 1
                continue
            self.router.apply_event(event)
            self._indexed.add(event.worker_id)
            self.stats.events += 1

    def _on_stream_reset(self) -> None:
        """The stream was recreated empty: forget every worker's cached blocks (not the
        workers). The clear is the router's own input, a `KvAllCleared` per worker, with
        event id -1 so the worker's next real event (ids count from 0) applies."""
        self.stats.stream_resets += 1
        workers, self._indexed = sorted(self._indexed), set()
        for worker_id in workers:
            self.router.apply_event(RouterEvent(worker_id, -1, KvAllCleared()))
        log.warning(
            "kv router: event stream of %s recreated; forgot the cached blocks of %d workers",
            self._events_filter,
            len(workers),
        )

    async def _on_load(self, msg: Msg) -> None:
        try:
            metrics = decode(msg.data, LoadMetrics)
        except msgspec.MsgspecError:
            self.stats.load_malformed += 1
            return
        if not self.membership.accepts(metrics.worker_id):
            self.stats.load_ignored += 1
            return
        self.router.update_load(metrics)
        self.stats.load_reports += 1

    def _on_instances(self, ready: list[int]) -> None:
        if self._closed:
            return
        for worker_id in self.membership.set_live(ready):
            self._remove(worker_id, "left the endpoint")

    async def _sweep(self) -> None:
        """Drop workers whose events arrived but who never became live (dead workers'
        history in the stream)."""
        while True:
            await asyncio.sleep(min(SWEEP_INTERVAL_S, self.membership.grace_s))
            for worker_id in self.membership.expire():
                self._remove(worker_id, "never became live")

    def _remove(self, worker_id: int, why: str) -> None:
        log.info("kv router: forgetting worker %016x (%s)", worker_id, why)
        self.router.remove_worker(worker_id)
        self._indexed.discard(worker_id)
        self.stats.workers_removed += 1

    # ------------------------------------------------------------------ internals

    async def _last_sequence(self) -> int:
        """Stream sequence of the newest event of this component now (0: none)."""
        try:
            msg = await self.runtime.js.get_last_msg(self.stream.name, self._events_filter)
        except NotFoundError:
            return 0
        return int(msg.seq or 0)


async def create_kv_router(
    runtime: DistributedRuntime,
    card: ModelCard,
    client: Client,
    *,
    overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT,
    temperature: float = 0.0,
    replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
    grace_s: float = DEFAULT_GRACE_S,
    busy: BusyThresholds | None = None,
    prediction: CachePrediction | None = None,
    replica_sync: ReplicaSyncSettings | None = None,
    tier_weights: TierWeights | None = None,
) -> KvRouter:
    """A `KvRouter` for the model of `card`, fed from NATS, with the stream's history of
    the card's namespace/component already applied (none read in approximate mode), and
    sharing its bookings with the endpoint's other routers unless `replica_sync` is
    disabled (None: enabled, default timing). `router.close()` unsubscribes."""
    prediction = prediction if prediction is not None else CachePrediction()
    router = build_kv_router(
        card,
        overlap_score_weight=overlap_score_weight,
        temperature=temperature,
        busy=busy,
        prediction=prediction,
        tier_weights=tier_weights,
    )
    feed = KvRouterFeed(
        runtime,
        router,
        card.namespace,
        card.component,
        client,
        grace_s=grace_s,
        kv_events=prediction.kv_events,
    )
    router.attach(feed)
    sync_settings = replica_sync if replica_sync is not None else ReplicaSyncSettings()
    try:
        if sync_settings.enabled:
            subject = router_sync_subject(card.namespace, card.component, card.endpoint)
            sync = RouterReplicaSync(runtime, router.scheduler, subject, sync_settings)
            router.attach(sync)
            await sync.start()
        await feed.start(replay_timeout_s)
    except BaseException:
        await router.close()
        raise
    return router
