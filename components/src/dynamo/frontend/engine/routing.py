"""`--router-mode`: which `Router` (`dynamo.llm.router`) each worker endpoint gets.

One router serves one worker endpoint of one model; the factory builds it when the
endpoint's first worker appears, from that worker's card (the KV router needs the model's
block size) and the endpoint's runtime client (the KV router follows its ready set).

Busy thresholds (`--busy-kv-usage`, `--busy-waiting-requests`) need the workers' load
reports, which only the KV router follows: in other modes they are ignored, with a warning.
When every worker is busy, a request waits in its endpoint's busy queue (`busy_queue`).

In kv mode each router shares its bookings of requests in flight with the routers of the
same endpoint in other frontend processes (`--http-workers`, other replicas) over NATS
(`dynamo.llm.kv_router.replica_sync`), unless `--no-router-replica-sync`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dynamo.frontend.engine.busy_queue import (
    DEFAULT_BUSY_QUEUE_SIZE,
    DEFAULT_BUSY_QUEUE_TIMEOUT_S,
    BusyQueueSettings,
)
from dynamo.llm.kv_router.anticipation import CachePrediction
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.nats_feed import create_kv_router
from dynamo.llm.kv_router.replica_sync import ReplicaSyncSettings
from dynamo.llm.kv_router.scheduler_defaults import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.llm.kv_router.tiers import (
    DEFAULT_DISK_TIER_WEIGHT,
    DEFAULT_HOST_TIER_WEIGHT,
    TierWeights,
)
from dynamo.llm.protocols import ModelCard
from dynamo.llm.router import RandomRouter, RoundRobinRouter, Router
from dynamo.runtime import Client, DistributedRuntime
from dynamo.runtime.cli import (
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    unit_interval,
)
from dynamo.runtime.settings import Flag, setting

log = logging.getLogger(__name__)


class RouterMode(str, enum.Enum):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    KV = "kv"


ROUTING_GROUP = "Routing"


@dataclass(frozen=True)
class RouterSettings:
    """How a worker is chosen per request (`--router-mode` and the kv router's knobs)."""

    mode: RouterMode = setting(
        RouterMode.ROUND_ROBIN,
        Flag(
            "--router-mode",
            "How a worker is chosen per request: round-robin, random, or kv (KV-cache aware: "
            "prefers workers that already hold the prompt's prefix, weighted by load).",
            type=RouterMode,
            choices=tuple(m.value for m in RouterMode),
            group=ROUTING_GROUP,
        ),
    )
    kv_overlap_score_weight: float = setting(
        DEFAULT_OVERLAP_SCORE_WEIGHT,
        Flag(
            "--kv-overlap-score-weight",
            "kv mode: weight of the prompt blocks a worker would still have to prefill, "
            "against its active blocks, in the routing cost (higher favours cache hits, "
            "lower favours balance).",
            type=non_negative_float,
            group=ROUTING_GROUP,
        ),
    )
    kv_host_tier_weight: float = setting(
        DEFAULT_HOST_TIER_WEIGHT,
        Flag(
            "--kv-host-tier-weight",
            "kv mode: what a prompt block a worker holds only in its host-memory tier "
            "(KV events with medium CPU: offloaded, to be copied back before use) saves, "
            "against one on its device (1): it counts at this weight in the blocks the "
            "worker would still prefill. Between 0 (no better than a miss) and 1 (as good "
            "as a device hit); a host copy is much cheaper than a prefill but not free.",
            type=unit_interval,
            group=ROUTING_GROUP,
        ),
    )
    kv_disk_tier_weight: float = setting(
        DEFAULT_DISK_TIER_WEIGHT,
        Flag(
            "--kv-disk-tier-weight",
            "kv mode: the same weight for a block held only on the worker's disk tier "
            "(medium STORAGE): slower to load back than host memory, so it saves less.",
            type=unit_interval,
            group=ROUTING_GROUP,
        ),
    )
    temperature: float = setting(
        0.0,
        Flag(
            "--router-temperature",
            "kv mode: softmax temperature over worker costs; 0 always picks the cheapest.",
            type=non_negative_float,
            group=ROUTING_GROUP,
        ),
    )
    kv_events: bool = setting(
        True,
        Flag(
            "--kv-events",
            "kv mode: read the workers' KV events. --no-kv-events reads none (for engines "
            "or deployments that publish none): the router assumes a worker caches the "
            "prompts it sent there for --router-ttl seconds (approximate mode). With "
            "events, a prompt routed to a worker also counts as cached there until its "
            "events confirm it.",
            negatable=True,
            group=ROUTING_GROUP,
        ),
    )
    ttl_s: float | None = setting(
        None,
        Flag(
            "--router-ttl",
            "kv mode: seconds a routed prompt's blocks count as cached on the worker "
            "without an event confirming them (default: 10 with events, 120 with "
            "--no-kv-events).",
            type=positive_float,
            group=ROUTING_GROUP,
        ),
    )
    replica_sync: bool = setting(
        True,
        Flag(
            "--router-replica-sync",
            "kv mode: share this router's bookings of requests in flight with the other "
            "frontends' routers of the same endpoint (--http-workers processes, replicas "
            "on other hosts) over core NATS, so that replicas behind one load balancer see "
            "every worker's whole load and do not all send a burst to the same idle "
            "worker. Cheap: a lone replica only sends a heartbeat a second. "
            "--no-router-replica-sync keeps each router's books to itself; "
            "$DYN_ROUTER_REPLICA_SYNC=0 sets that default.",
            env="DYN_ROUTER_REPLICA_SYNC",
            negatable=True,
            group=ROUTING_GROUP,
        ),
    )
    busy_kv_usage: float | None = setting(
        None,
        Flag(
            "--busy-kv-usage",
            "kv mode: a worker whose KV cache is at least this full (0-1, from its load "
            "reports and this router's bookings) gets no new requests; when every worker "
            "is busy the request waits in the busy queue (--busy-queue-size), or gets 503 "
            "with Retry-After. Default: $DYN_BUSY_KV_USAGE, else off.",
            type=fraction,
            env="DYN_BUSY_KV_USAGE",
            group=ROUTING_GROUP,
        ),
    )
    busy_waiting_requests: int | None = setting(
        None,
        Flag(
            "--busy-waiting-requests",
            "kv mode: a worker reporting at least this many waiting requests gets no new "
            "requests (when all are busy: the busy queue, or 503 with Retry-After). "
            "Default: $DYN_BUSY_WAITING_REQUESTS, else off.",
            type=positive_int,
            env="DYN_BUSY_WAITING_REQUESTS",
            group=ROUTING_GROUP,
        ),
    )

    busy_queue_size: int = setting(
        DEFAULT_BUSY_QUEUE_SIZE,
        Flag(
            "--busy-queue-size",
            "Requests each worker endpoint holds while every worker is busy (see the busy "
            "thresholds), served in `priority` order (vLLM's request field: lower first, "
            "default 0), first come first served within one priority; a request beyond "
            "the bound gets 503 at once. 0: no queue, 503 as soon as all are busy.",
            type=non_negative_int,
            group=ROUTING_GROUP,
        ),
    )
    busy_queue_timeout_s: float = setting(
        DEFAULT_BUSY_QUEUE_TIMEOUT_S,
        Flag(
            "--busy-queue-timeout",
            "Seconds a request waits in the busy queue for a worker with room before it "
            "gets 503 with Retry-After.",
            type=positive_float,
            group=ROUTING_GROUP,
        ),
    )

    @property
    def busy_queue(self) -> BusyQueueSettings:
        return BusyQueueSettings(self.busy_queue_size, self.busy_queue_timeout_s)

    @property
    def busy(self) -> BusyThresholds:
        return BusyThresholds(self.busy_kv_usage, self.busy_waiting_requests)

    @property
    def prediction(self) -> CachePrediction:
        return CachePrediction(self.kv_events, self.ttl_s)


RouterFactory = Callable[[ModelCard, Client], Awaitable[Router]]
"""Builds the router of one worker endpoint: (card of its first worker, its client)."""


def make_router_factory(settings: RouterSettings, runtime: DistributedRuntime) -> RouterFactory:
    """The factory for `--router-mode`. The KV router is fed by the workers' KV-event
    stream and load reports over `runtime`, and predicts caches from its own decisions
    until events confirm them; with `kv_events` False (`--no-kv-events`) it reads no
    events and its own decisions are the whole index, kept for the TTL. `busy_*`: when a
    worker is skipped as busy (kv mode). `replica_sync`: whether kv routers share their
    bookings with other replicas."""
    mode, busy, prediction = settings.mode, settings.busy, settings.prediction
    if busy.enabled and mode is not RouterMode.KV:
        log.warning("busy thresholds need --router-mode kv (worker load reports); ignored")
    if prediction != CachePrediction() and mode is not RouterMode.KV:
        log.warning("--no-kv-events and --router-ttl apply to --router-mode kv; ignored")

    async def round_robin(card: ModelCard, client: Client) -> Router:
        return RoundRobinRouter()

    async def random_choice(card: ModelCard, client: Client) -> Router:
        return RandomRouter()

    async def kv(card: ModelCard, client: Client) -> Router:
        return await create_kv_router(
            runtime,
            card,
            client,
            overlap_score_weight=settings.kv_overlap_score_weight,
            temperature=settings.temperature,
            busy=busy,
            prediction=prediction,
            replica_sync=ReplicaSyncSettings(enabled=settings.replica_sync),
            tier_weights=TierWeights(settings.kv_host_tier_weight, settings.kv_disk_tier_weight),
        )

    factories: dict[RouterMode, RouterFactory] = {
        RouterMode.ROUND_ROBIN: round_robin,
        RouterMode.RANDOM: random_choice,
        RouterMode.KV: kv,
    }
    return factories[mode]
