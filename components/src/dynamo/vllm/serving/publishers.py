"""The vLLM side of the KV router's feeds: vLLM's KV events and its load, as the worker
publishes them on NATS (`dynamo.llm.worker.ServedWorker` owns the publishers).

Thin glue between parts that each know one side:

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

from dynamo.llm.kv_router.publisher import KvEventPublisher
from dynamo.llm.kv_router.vllm_events import KvEventConverter
from dynamo.llm.kv_router.zmq_relay import KvEventRelay, publisher_binds
from dynamo.llm.protocols import LoadMetrics
from dynamo.vllm.serving.engine_stats import EngineStats

log = logging.getLogger(__name__)


def engine_load(
    worker_id: int, stats: EngineStats, num_gpu_blocks: int, speculative_k: int | None = None
) -> LoadMetrics:
    """The engine's latest scheduler snapshot as `LoadMetrics`, with the K in force of a
    speculating engine.

    vLLM reserves one block as the null block and computes usage over the rest, so the
    same count is used to turn the usage fraction back into blocks.
    """
    usable = max(num_gpu_blocks - 1, 0)
    snap = stats.snapshot
    usage = float(snap.kv_usage)
    return LoadMetrics(
        worker_id=worker_id,
        active_requests=int(snap.running),
        waiting_requests=int(snap.waiting),
        active_blocks=round(usage * usable),
        total_blocks=usable,
        kv_usage=usage,
        num_speculative_tokens=speculative_k,
    )


async def relay_kv_events(
    publisher: KvEventPublisher, block_size: int, endpoint: str, replay_endpoint: str | None
) -> KvEventRelay:
    """Relay the engine's KV events (vLLM's ZMQ publisher at `endpoint`) to `publisher`.
    The relay's opening `AllBlocksCleared` purges the worker's subject first (see
    `KvEventPublisher`)."""
    relay = KvEventRelay(
        endpoint,
        KvEventConverter(publisher.worker_id, block_size),
        publisher.publish_many,
        replay_endpoint=replay_endpoint,
        # vLLM connects its publisher to a named tcp://host:port: the relay listens there.
        listen=not publisher_binds(endpoint),
    )
    await relay.start()
    log.info("kv events: %s -> %s", relay.endpoint, publisher.subject)
    return relay
