"""The mocker's metrics for its system server (`--system-port`): per simulated worker,
with a `worker` label (instance id in hex), read from the engines at scrape time so the
step loop does no metrics work."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo.llm.worker import ServedWorker
from dynamo.mocker.backend import MockerBackend
from dynamo.runtime.supervise import restarts_so_far

log = logging.getLogger(__name__)


class MockerCollector(Collector):
    """Per-worker series named like the vLLM worker's `dynamo_worker_*` ones, plus
    simulator-only ones under `dynamo_mocker_*`."""

    def __init__(self, workers: Sequence[ServedWorker[MockerBackend]], model: str) -> None:
        self.workers = workers
        self.model = model

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "worker"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(kind: type, name: str, doc: str, value: float, worker: str, **extra: str) -> None:
            family = families.get(name)
            if family is None:
                family = kind(name, doc, labels=[*labels, *extra])
                families[name] = family
            family.add_metric([self.model, worker, *extra.values()], value)

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for worker in self.workers:
            hex_id = worker.instance_hex
            if hex_id is None:  # not connected yet
                continue
            engine = worker.backend.engine
            c = engine.counters
            pool = engine.pool
            add(
                gauge,
                "dynamo_worker_running_requests",
                "Requests running",
                engine.num_running,
                hex_id,
            )
            add(
                gauge,
                "dynamo_worker_restarts",
                "Times the supervisor restarted this worker before this run (launch scripts)",
                restarts_so_far(),
                hex_id,
            )
            add(
                gauge,
                "dynamo_worker_waiting_requests",
                "Requests waiting",
                engine.num_waiting,
                hex_id,
            )
            add(
                gauge,
                "dynamo_worker_kv_cache_usage",
                "Fraction of KV blocks in use",
                pool.usage,
                hex_id,
            )
            add(
                gauge,
                "dynamo_mocker_active_blocks",
                "KV blocks held by running requests",
                pool.active_blocks,
                hex_id,
            )
            add(
                gauge,
                "dynamo_mocker_cached_blocks",
                "KV blocks named by a content hash",
                pool.cached_blocks,
                hex_id,
            )
            add(
                counter,
                "dynamo_mocker_evicted_blocks",
                "Cached blocks evicted",
                pool.evictions,
                hex_id,
            )
            add(counter, "dynamo_mocker_steps", "Engine steps simulated", c.steps, hex_id)
            add(
                counter,
                "dynamo_mocker_preemptions",
                "Requests preempted for lack of blocks",
                c.preemptions,
                hex_id,
            )
            add(
                counter,
                "dynamo_worker_prompt_tokens",
                "Prompt tokens received",
                c.prompt_tokens,
                hex_id,
            )
            add(
                counter,
                "dynamo_worker_cached_prompt_tokens",
                "Prompt tokens served from the prefix cache",
                c.cached_prompt_tokens,
                hex_id,
            )
            add(
                counter,
                "dynamo_mocker_generated_tokens",
                "Tokens generated",
                c.generated_tokens,
                hex_id,
            )
            for reason, count in sorted(c.finished.items()):
                add(
                    counter,
                    "dynamo_worker_requests",
                    "Finished requests by reason",
                    count,
                    hex_id,
                    reason=reason,
                )
            if engine.k:
                add(
                    gauge,
                    "dynamo_worker_spec_decode_acceptance_rate",
                    "Accepted draft tokens / proposed draft tokens since start",
                    c.acceptance_rate,
                    hex_id,
                )
                add(
                    gauge,
                    "dynamo_worker_spec_decode_mean_acceptance_length",
                    "Tokens produced per verification step (bonus token included) since start",
                    c.mean_acceptance_length,
                    hex_id,
                )
                for position, rate in enumerate(c.per_position_rate()):
                    add(
                        gauge,
                        "dynamo_worker_spec_decode_acceptance_per_position",
                        "Fraction of drafts whose token at this position was accepted",
                        rate,
                        hex_id,
                        position=str(position),
                    )
        yield from families.values()
