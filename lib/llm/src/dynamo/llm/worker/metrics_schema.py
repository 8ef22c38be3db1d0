"""The `dynamo_worker_*` series every worker serves on its system server, defined once.

The vLLM worker and the mocker expose the same worker-level series under the same names,
so that a dashboard (deploy/grafana), the router's load view and the tests read either
the same way. Each collector keeps its own way of reading its engine and asks this module
for the family of a series: its name, type, help text and labels live here only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Kind(Enum):
    GAUGE = "gauge"
    COUNTER = "counter"


@dataclass(frozen=True)
class WorkerSeries:
    """One series: its name, kind, help text, and the labels it adds to the worker's."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()

    def family(self, worker_labels: list[str]) -> GaugeMetricFamily | CounterMetricFamily:
        """An empty family for it, labelled with `worker_labels` then its own labels."""
        family = GaugeMetricFamily if self.kind is Kind.GAUGE else CounterMetricFamily
        return family(self.name, self.help, labels=[*worker_labels, *self.labels])


RUNNING = WorkerSeries(
    "dynamo_worker_running_requests", Kind.GAUGE, "Requests running in the engine"
)
WAITING = WorkerSeries(
    "dynamo_worker_waiting_requests", Kind.GAUGE, "Requests waiting in the engine"
)
KV_USAGE = WorkerSeries("dynamo_worker_kv_cache_usage", Kind.GAUGE, "Fraction of KV blocks in use")
RESTARTS = WorkerSeries(
    "dynamo_worker_restarts",
    Kind.GAUGE,
    "Times the supervisor restarted this worker before this run (launch scripts)",
)
FINISHED = WorkerSeries(
    "dynamo_worker_requests", Kind.COUNTER, "Finished requests by finish reason", ("reason",)
)
PROMPT_TOKENS = WorkerSeries("dynamo_worker_prompt_tokens", Kind.COUNTER, "Prompt tokens received")
CACHED_PROMPT_TOKENS = WorkerSeries(
    "dynamo_worker_cached_prompt_tokens",
    Kind.COUNTER,
    "Prompt tokens served from the prefix cache or a KV connector",
)
ACCEPTANCE_RATE = WorkerSeries(
    "dynamo_worker_spec_decode_acceptance_rate",
    Kind.GAUGE,
    "Accepted draft tokens / proposed draft tokens since start",
)
MEAN_ACCEPTANCE_LENGTH = WorkerSeries(
    "dynamo_worker_spec_decode_mean_acceptance_length",
    Kind.GAUGE,
    "Tokens produced per verification step (bonus token included) since start",
)
ACCEPTANCE_PER_POSITION = WorkerSeries(
    "dynamo_worker_spec_decode_acceptance_per_position",
    Kind.GAUGE,
    "Fraction of drafts whose token at this position was accepted",
    ("position",),
)
