"""The vLLM worker's metrics for its system server (`--system-port`, served by
`dynamo.runtime.system_server.SystemServer`).

`/metrics` re-exposes vLLM's own Prometheus metrics (they live in the process-global
registry, including `vllm:spec_decode_*`) and adds `dynamo_worker_*` series derived from
the engine's stat logger, read at scrape time so nothing is updated on the hot path. The
speculation monitor (K in force, windowed acceptance, drift from `--speculation-profile`)
is observed at scrape time too, so its K follows the batch the scrape sees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dynamo.llm.worker import metrics_schema as schema
from dynamo.llm.worker.metrics_schema import WorkerSeries
from dynamo.runtime.supervise import restarts_so_far
from dynamo.vllm.serving.engine_stats import EngineStats
from dynamo.vllm.serving.handlers import RequestCounters
from dynamo.vllm.speculative.monitor import SpeculationMonitor

MonitorSource = Callable[[], SpeculationMonitor | None]
"""Returns the worker's monitor, observed with the latest stats (None before the engine
runs): the collector is registered before the engine starts, the monitor only after."""

log = logging.getLogger(__name__)


@dataclass(eq=False)
class VllmWorkerCollector(Collector):
    """Worker-level series; `labels` identify the worker (model, worker type, instance)."""

    stats: EngineStats
    counters: RequestCounters
    labels: dict[str, str]
    monitor: MonitorSource | None = None

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _one(self, series: WorkerSeries, value: float) -> GaugeMetricFamily | CounterMetricFamily:
        """A series of the shared schema with this worker's one value."""
        family = series.family(list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.stats.snapshot
        spec = self.stats.spec
        lv = list(self.labels.values())
        yield self._gauge(
            "dynamo_worker_requests_in_flight", "Requests being generated", self.counters.in_flight
        )
        yield self._one(schema.RESTARTS, restarts_so_far())
        yield self._one(schema.RUNNING, snap.running)
        yield self._one(schema.WAITING, snap.waiting)
        yield self._one(schema.KV_USAGE, snap.kv_usage)
        finished = schema.FINISHED.family(list(self.labels))
        for reason, n in sorted(self.counters.finished.items()):
            finished.add_metric([*lv, reason], n)
        yield finished
        # Both prompt counters, so a dashboard's prefix hit rate (cached / prompt) reads
        # the same on vLLM workers and mockers.
        yield self._one(schema.PROMPT_TOKENS, self.counters.prompt_tokens)
        yield self._one(schema.CACHED_PROMPT_TOKENS, self.counters.cached_prompt_tokens)
        remote = CounterMetricFamily(
            "dynamo_worker_remote_prefills",
            "Decode requests that came with a prefill worker's KV, by what this worker did "
            "with it (loaded, or refused: laid out unlike this engine's KV cache)",
            labels=[*self.labels, "outcome"],
        )
        remote.add_metric([*lv, "loaded"], self.counters.remote_prefill_used)
        remote.add_metric([*lv, "refused"], self.counters.remote_prefill_refused)
        yield remote
        yield self._one(schema.ACCEPTANCE_RATE, spec.acceptance_rate)
        yield self._one(schema.MEAN_ACCEPTANCE_LENGTH, spec.mean_acceptance_length)
        per_pos = schema.ACCEPTANCE_PER_POSITION.family(list(self.labels))
        for i, rate in enumerate(spec.per_position_rate()):
            per_pos.add_metric([*lv, str(i)], rate)
        yield per_pos
        yield from self._monitor_series()

    def _monitor_series(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The speculation monitor's series, once the engine runs (none before)."""
        monitor = self.monitor() if self.monitor is not None else None
        if monitor is None:
            return
        yield self._gauge(
            "dynamo_worker_spec_decode_k",
            "Draft tokens per step (K) in force for the current running batch",
            monitor.k_in_force,
        )
        if monitor.steps_at_k:
            steps = CounterMetricFamily(
                "dynamo_worker_spec_decode_k_steps",
                "Decoding steps the adaptive scheduler ran at each K (--speculation-adapt)",
                labels=[*self.labels, "k"],
            )
            for k, count in enumerate(monitor.steps_at_k):
                steps.add_metric([*self.labels.values(), str(k)], count)
            yield steps
        window = monitor.window_acceptance_length
        yield self._gauge(
            "dynamo_worker_spec_decode_window_acceptance_length",
            f"Tokens per verification step over the last complete {monitor.window_s:g}s "
            "window (the current one before any ended); NaN without drafts",
            float("nan") if window is None else window,
        )
        expected = monitor.profile_acceptance_length
        if expected is not None:
            yield self._gauge(
                "dynamo_worker_spec_decode_profile_acceptance_length",
                "Tokens per verification step --speculation-profile expects at the K in force",
                expected,
            )
        drift = CounterMetricFamily(
            "dynamo_worker_spec_decode_profile_drift_warnings",
            "Windows whose first-position acceptance strayed from --speculation-profile's",
            labels=list(self.labels),
        )
        drift.add_metric(list(self.labels.values()), monitor.drift_warnings)
        yield drift
