"""KV-aware routing: content hashes, the cache indexer, slot accounting and the router.

The core (hashing, indexer, active sequences, scheduler, `KvRouter`) is NATS-free: the
relay hands events to a callback and the router takes its inputs by call or from injected
async iterables, so it is tested without a broker. The NATS wiring lives in modules of
its own: `subjects` (names), `publisher` (`KvEventPublisher`, `LoadPublisher`: worker
side), `nats_feed` (`create_kv_router`: frontend side) and `replica_sync`
(`RouterReplicaSync`: bookings shared among frontend replicas, whose rules are the
NATS-free `replica_books.ReplicaBooks`).
"""

from dynamo.llm.kv_router.active_sequences import (
    ActiveSequences,
    MultiWorkerSequences,
    SequenceState,
    StepResult,
    WorkerLoad,
    speculative_depth,
)
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.hashing import compute_block_hashes, hash_block
from dynamo.llm.kv_router.indexer import KvIndexer, OverlapScores
from dynamo.llm.kv_router.nats_feed import KvRouterFeed, create_kv_router
from dynamo.llm.kv_router.publisher import KvEventPublisher, LoadPublisher
from dynamo.llm.kv_router.replica_books import ReplicaBooks
from dynamo.llm.kv_router.replica_sync import ReplicaSyncSettings, RouterReplicaSync
from dynamo.llm.kv_router.scheduler import (
    KvRouter,
    KvScheduler,
    KvWorkerSpec,
    RoutingDecision,
    RoutingTally,
    WorkerScore,
    build_kv_router,
)
from dynamo.llm.kv_router.vllm_events import KvEventConverter, decode_event_batch

__all__ = [
    "ActiveSequences",
    "BusyThresholds",
    "KvEventConverter",
    "KvEventPublisher",
    "KvIndexer",
    "KvRouter",
    "KvRouterFeed",
    "KvScheduler",
    "KvWorkerSpec",
    "LoadPublisher",
    "MultiWorkerSequences",
    "OverlapScores",
    "ReplicaBooks",
    "ReplicaSyncSettings",
    "RouterReplicaSync",
    "RoutingDecision",
    "RoutingTally",
    "SequenceState",
    "StepResult",
    "WorkerLoad",
    "WorkerScore",
    "build_kv_router",
    "compute_block_hashes",
    "create_kv_router",
    "decode_event_batch",
    "hash_block",
    "speculative_depth",
]
