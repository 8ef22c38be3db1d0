"""KV-aware routing: content hashes, the cache indexer, slot accounting and the router.

The core is NATS-free on purpose: the relay hands events to a callback and the router
takes its inputs by call or from injected async iterables, so it is testable without a
broker. The NATS wiring lives in three modules of its own, imported only on first use so
that importing the core never imports nats: `subjects` (names), `publisher`
(`KvEventPublisher`, `LoadPublisher`: worker side) and `nats_feed` (`create_kv_router`:
frontend side).
"""

from typing import Any

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
    RoutingTally,
    WorkerConfig,
    WorkerScore,
    build_kv_router,
)
from dynamo.llm.kv_router.vllm_events import KvEventConverter, decode_event_batch

_NATS_EXPORTS = {
    "create_kv_router": "dynamo.llm.kv_router.nats_feed",
    "KvRouterFeed": "dynamo.llm.kv_router.nats_feed",
    "KvEventPublisher": "dynamo.llm.kv_router.publisher",
    "LoadPublisher": "dynamo.llm.kv_router.publisher",
}


def __getattr__(name: str) -> Any:
    """The NATS-backed names, imported on first use (PEP 562)."""
    module = _NATS_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "ActiveSequences",
    "KvEventConverter",
    "KvEventPublisher",
    "KvIndexer",
    "KvRouter",
    "KvRouterFeed",
    "KvScheduler",
    "LoadPublisher",
    "MultiWorkerSequences",
    "OverlapScores",
    "RoutingDecision",
    "RoutingTally",
    "SequenceState",
    "StepResult",
    "WorkerConfig",
    "WorkerLoad",
    "WorkerScore",
    "build_kv_router",
    "compute_block_hashes",
    "create_kv_router",
    "decode_event_batch",
    "hash_block",
    "speculative_depth",
]
