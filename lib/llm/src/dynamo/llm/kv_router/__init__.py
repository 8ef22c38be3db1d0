"""KV-aware routing: content hashes, the cache indexer, slot accounting and the router.

The core is NATS-free: `hashing`, `indexer`, `active_sequences` (one worker's slot
books) and `multi_worker_sequences` (those of every worker, by request), the `scheduler`
(`KvScheduler`: costs and books) with `selection` (the choice among scored workers and
its records), `worker_spec` (`KvWorkerSpec`) and `scheduler_defaults` (tuned knob
defaults), and `router` (`KvRouter`, `build_kv_router`). The relay hands events to a
callback and the router takes its inputs by call or from injected async iterables, so
the core is tested without a broker. The NATS wiring lives in modules of its own:
`subjects` (names), `publisher` (`KvEventPublisher`, `LoadPublisher`: worker side),
`nats_feed` (`create_kv_router`: frontend side) and `replica_sync` (`RouterReplicaSync`:
bookings shared among frontend replicas, whose rules are the NATS-free
`replica_books.ReplicaBooks`).
"""

from dynamo.llm.kv_router.active_sequences import (
    ActiveSequences,
    SequenceState,
    StepResult,
    WorkerLoad,
    speculative_depth,
)
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.hashing import compute_block_hashes, hash_block
from dynamo.llm.kv_router.indexer import KvIndexer, OverlapScores
from dynamo.llm.kv_router.multi_worker_sequences import MultiWorkerSequences
from dynamo.llm.kv_router.nats_feed import KvRouterFeed, create_kv_router
from dynamo.llm.kv_router.publisher import KvEventPublisher, LoadPublisher
from dynamo.llm.kv_router.replica_books import ReplicaBooks
from dynamo.llm.kv_router.replica_sync import ReplicaSyncSettings, RouterReplicaSync
from dynamo.llm.kv_router.router import KvRouter, build_kv_router
from dynamo.llm.kv_router.scheduler import KvScheduler
from dynamo.llm.kv_router.selection import RoutingDecision, RoutingTally, WorkerScore
from dynamo.llm.kv_router.vllm_events import KvEventConverter, decode_event_batch
from dynamo.llm.kv_router.worker_spec import KvWorkerSpec

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
