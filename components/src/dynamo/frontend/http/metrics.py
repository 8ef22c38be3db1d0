"""Prometheus metrics of the HTTP frontend, in a registry of its own.

An own `CollectorRegistry` (not the process-global one) keeps `/metrics` to exactly the
frontend's series and lets tests build independent frontends in one process. Every series
carries the served model name, so one frontend serving several models stays readable.

With `--http-workers N` the N processes share one port, so a scrape reaches one of them
at random. Each child then runs prometheus_client in multiprocess mode (the parent gives
it `PROMETHEUS_MULTIPROC_DIR`, a private directory it creates and removes): every value
lives in a memory-mapped file there, and `render` (given `multiprocess_dir`) sums the
files of all N processes, so any process answers for the whole frontend. The in-flight
gauge sums over live processes (`livesum`); counters and histograms sum over all. The
exposition keeps the single-process shape: each family's own help text (the library
would write "Multiprocess metric"), and the `# TYPE` line of a family no process has
observed yet (the library would leave it out), which dashboards' queries rely on.

`RequestMetrics` follows one request: in-flight gauge, time to first token, inter-token
latency (per token: a speculative step that yields K+1 tokens counts as K+1 tokens sharing
the step's gap), duration, output tokens and the final status.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from dynamo.frontend.engine.busy_queue import QueueOutcome
from dynamo.frontend.engine.prefill_policy import PrefillDecision
from dynamo.llm.protocols import SpecDecodeStats
from dynamo.runtime.naming import instance_hex

PREFIX = "dynamo_frontend"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 131072)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class FrontendMetrics:
    """All frontend series; one instance per HTTP service."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, multiprocess_dir: Path | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.multiprocess_dir = multiprocess_dir
        self.requests = self._counter(
            "requests",
            "Requests by model, endpoint, request type (stream/unary) and HTTP status",
            ["model", "endpoint", "request_type", "status"],
        )
        self.inflight = self._live_gauge("inflight_requests", "Requests being served")
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "From request arrival to the first generated token",
            _TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Time between generated tokens, per token",
            _ITL_BUCKETS,
        )
        self.duration = self._histogram(
            "request_duration_seconds",
            "From request arrival to the end of the response",
            _DURATION_BUCKETS,
        )
        self.input_tokens = self._histogram(
            "input_sequence_tokens",
            "Prompt length in tokens",
            _TOKEN_BUCKETS,
        )
        self.output_tokens = self._counter("output_tokens", "Generated tokens")
        self.disconnects = self._counter(
            "client_disconnects",
            "Requests whose client went away before the response ended",
        )
        self.rejected = self._counter(
            "rejected_requests",
            "Requests turned away before any work by the frontend's own bounds, by reason: "
            "inflight_limit, worker_wait_limit, busy_queue_full and busy_queue_timeout "
            "(503 with Retry-After), unauthorized (401)",
            ["model", "reason"],
        )
        self.queued = self._live_gauge(
            "queued_requests",
            "Requests waiting in the busy queue for a worker with room (every worker busy)",
        )
        self.queue_wait = Histogram(
            f"{PREFIX}_queue_wait_seconds",
            "Time requests spent in the busy queue, by how they left it: admitted, "
            "timed_out (503) or cancelled (the client went away)",
            ["model", "outcome"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.prefill_fallbacks = self._counter(
            "prefill_fallbacks",
            "Disaggregated requests the decode worker had to prefill itself",
        )
        self.prefill_decisions = self._counter(
            "prefill_decisions",
            "Where disaggregated requests' prompts were prefilled (placement: remote on a "
            "prefill worker, local on the decode worker) and why (reason: long_prompt, "
            "always_remote, short_prompt, cached_on_decode, prefill_pool_busy, n_choices, "
            "no_prefill_worker)",
            ["model", "placement", "reason"],
        )
        self.migrations = self._counter(
            "migrations",
            "Streams moved to another worker mid-stream after theirs was lost (per move)",
        )
        self.router_decisions = self._counter(
            "router_decisions",
            "Placements made by the router, per worker instance (hex id) and kind: new, "
            "retry (lost or refused before output), migration (after tokens streamed)",
            ["model", "component", "worker", "placement"],
        )
        self.router_overlap_blocks = self._counter(
            "router_overlap_blocks",
            "Prompt blocks the KV router expected cached on the worker it chose, summed "
            "over its placements (divide by router_decisions_total for blocks per decision)",
            ["model", "component", "worker"],
        )
        self.spec_drafts = self._counter(
            "spec_decode_drafts",
            "Speculative verification steps reported by workers",
        )
        self.spec_draft_tokens = self._counter("spec_decode_draft_tokens", "Draft tokens proposed")
        self.spec_accepted_tokens = self._counter(
            "spec_decode_accepted_tokens",
            "Draft tokens accepted",
        )

    def _counter(self, name: str, documentation: str, labels: list[str] | None = None) -> Counter:
        """A counter of this frontend's registry, by model unless `labels` says otherwise."""
        return Counter(
            f"{PREFIX}_{name}", documentation, labels or ["model"], registry=self.registry
        )

    def _live_gauge(self, name: str, documentation: str) -> Gauge:
        """A gauge by model that sums over the live processes (`--http-workers`)."""
        return Gauge(
            f"{PREFIX}_{name}",
            documentation,
            ["model"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        """A histogram by model in this frontend's registry."""
        return Histogram(
            f"{PREFIX}_{name}", documentation, ["model"], buckets=buckets, registry=self.registry
        )

    def prefill_fallback(self, model: str, reason: str) -> None:
        """Disaggregated serving fell back to prefill on the decode worker."""
        self.prefill_fallbacks.labels(model).inc()

    def prefill_decision(self, model: str, decision: PrefillDecision) -> None:
        """Conditional disaggregation placed a request's prefill (remote or local)."""
        placement = "remote" if decision.remote else "local"
        self.prefill_decisions.labels(model, placement, decision.reason.value).inc()

    def migration(self, model: str) -> None:
        """A request continued on another worker after its worker was lost mid-stream."""
        self.migrations.labels(model).inc()

    def routed(
        self,
        component: str,
        model: str,
        instance_id: int,
        placement: str,
        overlap_blocks: int | None,
    ) -> None:
        """The router placed a request of `model` on `instance_id` of `component`; the
        overlap counter moves only for routers that estimate it (kv mode), so the blocks
        per decision panel is not diluted by round-robin placements' unknown overlap."""
        worker = instance_hex(instance_id)
        self.router_decisions.labels(model, component, worker, placement).inc()
        if overlap_blocks is not None:
            self.router_overlap_blocks.labels(model, component, worker).inc(overlap_blocks)

    def queue_entered(self, model: str) -> None:
        """Every worker was busy: the request joined its endpoint's busy queue."""
        self.queued.labels(model).inc()

    def queue_left(self, model: str, outcome: QueueOutcome, waited_s: float) -> None:
        self.queued.labels(model).dec()
        self.queue_wait.labels(model, outcome.value).observe(waited_s)
        if outcome is QueueOutcome.TIMED_OUT:
            self.count_shed(model, "busy_queue_timeout")

    def queue_rejected(self, model: str) -> None:
        self.count_shed(model, "busy_queue_full")

    def request(self, model: str, endpoint: str, stream: bool) -> RequestMetrics:
        return RequestMetrics(self, model, endpoint, stream)

    def count_rejected(self, model: str, endpoint: str, stream: bool, status: int) -> None:
        """A request that failed before it reached an engine."""
        self.requests.labels(model, endpoint, _request_type(stream), str(status)).inc()

    def count_shed(self, model: str, reason: str) -> None:
        """A request the frontend refused to take on (`rejected_requests_total`)."""
        self.rejected.labels(model, reason).inc()

    def render(self) -> bytes:
        """The exposition text: this process's series, or with `multiprocess_dir` every
        process's (`--http-workers`), summed."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        merged.register(AllProcesses(self.registry, self.multiprocess_dir))
        return generate_latest(merged)


class AllProcesses:
    """A collector of every process's samples in a multiprocess directory, with the
    families, help texts and types of `declared` (this process's registry)."""

    def __init__(self, declared: CollectorRegistry, path: Path) -> None:
        self._declared = declared
        self._path = path

    def collect(self) -> Iterator[Metric]:
        declared = {family.name: family for family in self._declared.collect()}
        for family in MultiProcessCollector(None, path=str(self._path)).collect():
            own = declared.pop(family.name, None)
            if own is not None:
                family.documentation = own.documentation
            yield family
        yield from declared.values()  # observed by no process yet: no samples


def _request_type(stream: bool) -> str:
    return "stream" if stream else "unary"


class RequestMetrics:
    """Observations of one request; `finish(status)` must be called exactly once."""

    __slots__ = (
        "_endpoint",
        "_finished",
        "_last_token_at",
        "_m",
        "_model",
        "_start",
        "_stream",
        "output_tokens",
    )

    def __init__(self, metrics: FrontendMetrics, model: str, endpoint: str, stream: bool) -> None:
        self._m = metrics
        self._model = model
        self._endpoint = endpoint
        self._stream = stream
        self._start = time.monotonic()
        self._last_token_at: float | None = None
        self._finished = False
        self.output_tokens = 0
        metrics.inflight.labels(model).inc()

    def tokens(self, count: int) -> None:
        """`count` tokens arrived now (one engine batch)."""
        if count <= 0:
            return
        now = time.monotonic()
        m = self._m
        if self._last_token_at is None:
            # The first batch defines TTFT; tokens arriving with it have no gap to measure.
            m.ttft.labels(self._model).observe(now - self._start)
        else:
            gap = (now - self._last_token_at) / count
            itl = m.itl.labels(self._model)
            for _ in range(count):
                itl.observe(gap)
        self._last_token_at = now
        self.output_tokens += count

    def prompt(self, tokens: int) -> None:
        self._m.input_tokens.labels(self._model).observe(tokens)

    def spec_decode(self, stats: SpecDecodeStats | None) -> None:
        if stats is None:
            return
        m = self._m
        m.spec_drafts.labels(self._model).inc(stats.num_drafts)
        m.spec_draft_tokens.labels(self._model).inc(stats.num_draft_tokens)
        m.spec_accepted_tokens.labels(self._model).inc(stats.num_accepted_tokens)

    def disconnected(self) -> None:
        self._m.disconnects.labels(self._model).inc()

    def finish(self, status: int) -> None:
        if self._finished:
            return
        self._finished = True
        m = self._m
        m.inflight.labels(self._model).dec()
        m.duration.labels(self._model).observe(time.monotonic() - self._start)
        m.output_tokens.labels(self._model).inc(self.output_tokens)
        m.requests.labels(
            self._model, self._endpoint, _request_type(self._stream), str(status)
        ).inc()
