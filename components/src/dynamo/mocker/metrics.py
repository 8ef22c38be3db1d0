"""The mocker's metrics for its system server (`--system-port`): per simulated worker,
with a `worker` label (instance id in hex), read from the engines at scrape time so the
step loop does no metrics work."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo.llm.worker import ServedWorker
from dynamo.llm.worker import metrics_schema as schema
from dynamo.llm.worker.metrics_schema import Kind, WorkerSeries
from dynamo.mocker.backend import MockerBackend
from dynamo.runtime.supervise import restarts_so_far

log = logging.getLogger(__name__)


ACTIVE_BLOCKS = WorkerSeries(
    "dynamo_mocker_active_blocks", Kind.GAUGE, "KV blocks held by running requests"
)
CACHED_BLOCKS = WorkerSeries(
    "dynamo_mocker_cached_blocks", Kind.GAUGE, "KV blocks named by a content hash"
)
EVICTED_BLOCKS = WorkerSeries("dynamo_mocker_evicted_blocks", Kind.COUNTER, "Cached blocks evicted")
HOST_TIER_BLOCKS = WorkerSeries(
    "dynamo_mocker_host_tier_blocks", Kind.GAUGE, "KV blocks held in the host tier"
)
ONBOARDED_TOKENS = WorkerSeries(
    "dynamo_mocker_onboarded_tokens",
    Kind.COUNTER,
    "Prompt tokens loaded back from the host tier instead of computed (counted as cached)",
)
STEPS = WorkerSeries("dynamo_mocker_steps", Kind.COUNTER, "Engine steps simulated")
PREEMPTIONS = WorkerSeries(
    "dynamo_mocker_preemptions", Kind.COUNTER, "Requests preempted for lack of blocks"
)
GENERATED_TOKENS = WorkerSeries("dynamo_mocker_generated_tokens", Kind.COUNTER, "Tokens generated")
COMPUTED_PROMPT_TOKENS = WorkerSeries(
    "dynamo_mocker_computed_prompt_tokens",
    Kind.COUNTER,
    "Prompt tokens computed by this worker's steps (recomputation after preemption included)",
)
TRANSFERRED_PROMPT_TOKENS = WorkerSeries(
    "dynamo_mocker_transferred_prompt_tokens",
    Kind.COUNTER,
    "Prompt tokens whose KV a decode worker received from a prefill worker instead of "
    "computing them (part of dynamo_worker_cached_prompt_tokens)",
)
REMOTE_PREFILLS = WorkerSeries(
    "dynamo_worker_remote_prefills",
    Kind.COUNTER,
    "Decode requests that came with a prefill worker's KV, by what this worker did with it "
    "(loaded, or refused: not a handoff it can take, prefilled locally)",
    ("outcome",),
)
"""Named and labelled as the vLLM worker's series of the same name."""


class MockerCollector(Collector):
    """Per-worker series named like the vLLM worker's `dynamo_worker_*` ones (one schema,
    `metrics_schema`), plus simulator-only ones under `dynamo_mocker_*`."""

    def __init__(self, workers: Sequence[ServedWorker[MockerBackend]], model: str) -> None:
        self.workers = workers
        self.model = model

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "worker"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(series: WorkerSeries, value: float, worker: str, **extra: str) -> None:
            family = families.get(series.name)
            if family is None:
                family = families[series.name] = series.family(labels)
            family.add_metric([self.model, worker, *extra.values()], value)

        for worker in self.workers:
            hex_id = worker.instance_hex
            if hex_id is None:  # not connected yet
                continue
            engine = worker.backend.engine
            c = engine.counters
            pool = engine.pool
            add(schema.RUNNING, engine.num_running, hex_id)
            add(schema.RESTARTS, restarts_so_far(), hex_id)
            add(schema.WAITING, engine.num_waiting, hex_id)
            add(schema.KV_USAGE, pool.usage, hex_id)
            add(ACTIVE_BLOCKS, pool.active_blocks, hex_id)
            add(CACHED_BLOCKS, pool.cached_blocks, hex_id)
            add(EVICTED_BLOCKS, pool.evictions, hex_id)
            if pool.host is not None:
                add(HOST_TIER_BLOCKS, len(pool.host), hex_id)
                add(ONBOARDED_TOKENS, c.onboarded_tokens, hex_id)
            add(STEPS, c.steps, hex_id)
            add(PREEMPTIONS, c.preemptions, hex_id)
            add(schema.PROMPT_TOKENS, c.prompt_tokens, hex_id)
            add(schema.CACHED_PROMPT_TOKENS, c.cached_prompt_tokens, hex_id)
            add(GENERATED_TOKENS, c.generated_tokens, hex_id)
            add(COMPUTED_PROMPT_TOKENS, c.computed_prefill_tokens, hex_id)
            add(TRANSFERRED_PROMPT_TOKENS, c.transferred_prompt_tokens, hex_id)
            add(REMOTE_PREFILLS, c.kv_transfers, hex_id, outcome="loaded")
            add(REMOTE_PREFILLS, c.kv_transfers_refused, hex_id, outcome="refused")
            for reason, count in sorted(c.finished.items()):
                add(schema.FINISHED, count, hex_id, reason=reason)
            if engine.k:
                add(schema.ACCEPTANCE_RATE, c.acceptance_rate, hex_id)
                add(schema.MEAN_ACCEPTANCE_LENGTH, c.mean_acceptance_length, hex_id)
                for position, rate in enumerate(c.per_position_rate()):
                    add(schema.ACCEPTANCE_PER_POSITION, rate, hex_id, position=str(position))
        yield from families.values()
