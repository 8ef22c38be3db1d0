"""The worker's KV-router feeds: vLLM's KV events and load, published on NATS.

Thin glue between three parts that each know one side:

* vLLM's ZMQ KV-event publisher (configured by `args` into the engine args before the
  engine starts: ``kv_events_config`` with ``publisher: zmq``, an endpoint and a
  ``replay_endpoint``) → `KvEventRelay` (pyzmq, gap replay, re-keying by content hash)
  → `KvEventPublisher` (the worker's JetStream subject);
* the engine's scheduler stats (`EngineStats`, updated every step) → `LoadPublisher`
  (the worker's core load subject).

Load reported to routers: ``active_blocks = round(kv_usage × usable blocks)``. vLLM's
``kv_cache_usage`` counts blocks referenced by running requests, and those include the
slots allocated ahead for speculative tokens, so speculation is in the number without
the worker keeping books of its own. Blocks only cached (free, reusable) are not counted.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from dynamo.llm.kv_router.publisher import KvEventPublisher, LoadPublisher, LoadSource
from dynamo.llm.kv_router.vllm_events import KvEventConverter
from dynamo.llm.kv_router.zmq_relay import KvEventRelay
from dynamo.llm.protocols import LoadMetrics
from dynamo.runtime import Component, DistributedRuntime
from dynamo.vllm.engine_stats import EngineStats

log = logging.getLogger(__name__)


class KvWorker(Protocol):
    """What `start_kv_publishers` reads from the worker (`dynamo.vllm.main.Worker`)."""

    runtime: DistributedRuntime
    engine: Any  # VllmEngine: `.facts` (block_size, num_gpu_blocks) and `.stats`
    cfg: Any  # WorkerConfig: `.kv_events_endpoint`, `.kv_events_replay_endpoint`


def engine_load_source(worker_id: int, stats: EngineStats, num_gpu_blocks: int) -> LoadSource:
    """Reads the engine's latest scheduler snapshot as `LoadMetrics`.

    vLLM reserves one block as the null block and computes usage over the rest, so the
    same count is used to turn the usage fraction back into blocks.
    """
    usable = max(num_gpu_blocks - 1, 0)

    def load() -> LoadMetrics:
        snap = stats.snapshot
        usage = float(snap.kv_usage)
        return LoadMetrics(
            worker_id=worker_id,
            active_requests=int(snap.running),
            waiting_requests=int(snap.waiting),
            active_blocks=round(usage * usable),
            total_blocks=usable,
            kv_usage=usage,
        )

    return load


async def start_kv_event_relay(
    runtime: DistributedRuntime,
    component: Component,
    block_size: int,
    endpoint: str,
    replay_endpoint: str | None,
) -> KvEventRelay:
    """Relay the engine's KV events to this worker's JetStream subject. The relay's
    opening `AllBlocksCleared` purges the subject first (see `KvEventPublisher`)."""
    worker_id = runtime.instance_id
    publisher = await KvEventPublisher(
        runtime, component.namespace, component.name, worker_id
    ).start()
    relay = KvEventRelay(
        endpoint,
        KvEventConverter(worker_id, block_size),
        publisher.publish,
        replay_endpoint=replay_endpoint,
    )
    await relay.start()
    log.info("kv events: %s -> %s", relay.endpoint, publisher.subject)
    return relay


async def start_kv_publishers(
    worker: KvWorker, component: Component
) -> tuple[KvEventRelay | None, LoadPublisher]:
    """Start the KV-event relay (None when the engine publishes no KV events, e.g.
    prefix caching off) and the load publisher; both have `async stop()`."""
    runtime = worker.runtime
    facts = worker.engine.facts
    if facts is None:
        raise RuntimeError("start the engine before its publishers")
    relay: KvEventRelay | None = None
    endpoint = worker.cfg.kv_events_endpoint
    if endpoint:
        relay = await start_kv_event_relay(
            runtime, component, facts.block_size, endpoint, worker.cfg.kv_events_replay_endpoint
        )
    else:
        log.info("kv events off: routers will see this worker's load but not its cache")
    source = engine_load_source(runtime.instance_id, worker.engine.stats, facts.num_gpu_blocks)
    load = await LoadPublisher(
        runtime, component.namespace, component.name, runtime.instance_id, source
    ).start()
    return relay, load
