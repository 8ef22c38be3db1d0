"""KV-aware routing: content hashes, the cache indexer, slot accounting and the router.

NATS-free on purpose: the relay hands events to a callback and the router takes its
inputs by call or from injected async iterables, so everything here is testable without
a broker. The NATS wiring (`create_kv_router`, the relay's JetStream publisher) lives with
the components that own the connections.
"""

from dynamo.llm.kv_router.active_sequences import (
    ActiveSequences,
    MultiWorkerSequences,
    SequenceState,
    StepResult,
    WorkerLoad,
    speculative_depth,
)
from dynamo.llm.kv_router.hashing import compute_block_hashes, hash_block
from dynamo.llm.kv_router.indexer import KvIndexer, OverlapScores
from dynamo.llm.kv_router.scheduler import (
    KvRouter,
    KvScheduler,
    RoutingDecision,
    WorkerConfig,
    WorkerScore,
    build_kv_router,
)
from dynamo.llm.kv_router.vllm_events import KvEventConverter, decode_event_batch

__all__ = [
    "ActiveSequences",
    "KvEventConverter",
    "KvIndexer",
    "KvRouter",
    "KvScheduler",
    "MultiWorkerSequences",
    "OverlapScores",
    "RoutingDecision",
    "SequenceState",
    "StepResult",
    "WorkerConfig",
    "WorkerLoad",
    "WorkerScore",
    "build_kv_router",
    "compute_block_hashes",
    "decode_event_batch",
    "hash_block",
    "speculative_depth",
]
