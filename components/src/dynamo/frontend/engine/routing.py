"""`--router-mode`: which `Router` (`dynamo.llm.router`) each worker endpoint gets.

One router serves one worker endpoint of one model; the factory builds it when the
endpoint's first worker appears, from that worker's card (the KV router needs the model's
block size) and the endpoint's runtime client (the KV router follows its ready set).

Busy thresholds (`--busy-kv-usage`, `--busy-waiting-requests`) need the workers' load
reports, which only the KV router follows: in other modes they are ignored, with a warning.

In kv mode each router shares its bookings of requests in flight with the routers of the
same endpoint in other frontend processes (`--http-workers`, other replicas) over NATS
(`dynamo.llm.kv_router.replica_sync`), unless `--no-router-replica-sync`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable

from dynamo.llm.kv_router.anticipation import CachePrediction
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.nats_feed import create_kv_router
from dynamo.llm.kv_router.replica_sync import ReplicaSyncSettings
from dynamo.llm.kv_router.scheduler import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.llm.protocols import ModelCard
from dynamo.llm.router import RandomRouter, RoundRobinRouter, Router
from dynamo.runtime import Client, DistributedRuntime

log = logging.getLogger(__name__)


class RouterMode(str, enum.Enum):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    KV = "kv"


RouterFactory = Callable[[ModelCard, Client], Awaitable[Router]]
"""Builds the router of one worker endpoint: (card of its first worker, its client)."""


def make_router_factory(
    mode: RouterMode,
    runtime: DistributedRuntime,
    *,
    kv_overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT,
    router_temperature: float = 0.0,
    busy: BusyThresholds | None = None,
    prediction: CachePrediction | None = None,
    replica_sync: ReplicaSyncSettings | None = None,
) -> RouterFactory:
    """The factory for `--router-mode`. The KV router is fed by the workers' KV-event
    stream and load reports over `runtime`, and predicts caches from its own decisions
    until events confirm them; with `prediction.kv_events` False (`--no-kv-events`) it
    reads no events and its own decisions are the whole index, kept for the TTL.
    `busy`: when a worker is skipped as busy (kv mode). `replica_sync`: whether (and how
    often) kv routers share their bookings with other replicas (None: on, defaults)."""
    if busy is not None and busy.enabled and mode is not RouterMode.KV:
        log.warning("busy thresholds need --router-mode kv (worker load reports); ignored")
    if prediction is not None and prediction != CachePrediction() and mode is not RouterMode.KV:
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
            overlap_score_weight=kv_overlap_score_weight,
            temperature=router_temperature,
            busy=busy,
            prediction=prediction,
            replica_sync=replica_sync,
        )

    factories: dict[RouterMode, RouterFactory] = {
        RouterMode.ROUND_ROBIN: round_robin,
        RouterMode.RANDOM: random_choice,
        RouterMode.KV: kv,
    }
    return factories[mode]
