"""The seam between a worker's engine and the rest of the worker: `EngineBackend`, and the
plain data on either side of it (`EngineDescription`, `WorkerRegistration`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dynamo.llm.kv_router.publisher import KvEventPublisher
from dynamo.llm.protocols import (
    KvStorageProbe,
    LLMEngineOutput,
    LoadMetrics,
    PreprocessedRequest,
    SamplingDefaults,
    SpeculativeInfo,
    WorkerType,
)
from dynamo.runtime import Context
from dynamo.runtime.nats_options import NatsConnectOptions

DEFAULT_DRAIN_TIMEOUT_S = 30.0
"""How long requests in flight may finish after a worker is asked to stop (`--drain-timeout`)."""

DEFAULT_MIGRATION_LIMIT = 3
"""How often, by default, a frontend may move a request off an aggregated or decode worker
that dies mid-stream (a prefill worker's default is 0: its single output is never
migrated, a lost prefill leg falls back to local prefill instead)."""

CLEAR_KV_BLOCKS_ENDPOINT = "clear_kv_blocks"
"""Endpoint every worker serves next to `generate`: drop the cached prefix blocks."""


@dataclass(frozen=True)
class EngineDescription:
    """What a started engine tells routers and frontends about itself (its model card's
    engine fields)."""

    context_length: int
    kv_block_size: int
    total_kv_blocks: int
    max_num_seqs: int
    eos_token_ids: list[int] = field(default_factory=list)
    speculative: SpeculativeInfo | None = None
    sampling_defaults: SamplingDefaults | None = None
    """The model's defaults for sampling fields a request leaves unset (see the card)."""
    kv_storage: KvStorageProbe | None = None
    """A prefill worker's KV-transfer directory probe (disk-based connectors), on its card."""


@dataclass(frozen=True)
class WorkerRegistration:
    """Where and as what a worker registers, and how it leaves."""

    served_model_name: str
    model_path: Path
    """Local model directory; its tokenizer files travel with the model card."""
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    worker_type: WorkerType = WorkerType.AGGREGATED
    nats_server: str | None = None  # None: $NATS_SERVER or nats://127.0.0.1:4222
    nats_options: NatsConnectOptions | None = None  # None: the NATS_* variables
    lease_ttl: float | None = None  # None: $DYN_LEASE_TTL or the runtime default
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    migration_limit: int = 0
    publish_kv_events: bool = True
    max_inflight_requests: int | None = None
    """Bound on requests accepted at once (0: none; None: from the engine, see
    `dynamo.llm.worker.inflight`)."""
    advertise_host: str | None = None
    """The address peers on other hosts reach this worker at (`--advertise-host`): put in
    its instance records (metadata `host`) and on its model card. None: not advertised."""
    advertised_addresses: dict[str, str] = field(default_factory=dict)
    """Further sockets the worker listens on for other hosts, by name (e.g. `kv_events`:
    `tcp://HOST:PORT`), put in its instance records' metadata next to `host`."""


class Stoppable(Protocol):
    """Background work a worker owns and stops on its way out."""

    async def stop(self) -> None: ...


class EngineBackend(Protocol):
    """The engine glue of one worker: all a new backend has to write."""

    async def start(self) -> EngineDescription:
        """Load the engine. May take long: keep the event loop free (a thread), so the
        system server answers 503 and signals are handled meanwhile. Raise
        `dynamo.runtime.cli.ConfigError` for a configuration the engine refuses."""
        ...

    def is_ready(self) -> bool:
        """Started and able to serve."""
        ...

    def dead_reason(self) -> str | None:
        """Why the engine can no longer serve once it started (None while it can): the
        process then deregisters and exits 1, so an orchestrator restarts it."""
        ...

    def generate(
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """The `generate` endpoint: the engine's outputs for one request. When the client
        goes away the runtime closes this generator (abort the request there)."""
        ...

    async def clear_kv_blocks(self) -> bool:
        """Drop every cached prefix block; False when it could not (requests running)."""
        ...

    def load_metrics(self, worker_id: int) -> LoadMetrics:
        """The engine's load now, as routers read it (sampled after each `watch_load` call
        and at every heartbeat)."""
        ...

    def watch_load(self, changed: Callable[[], None]) -> None:
        """Call `changed` (on the event loop) whenever the load may have changed: after
        every engine step, and when a request leaves between steps. The worker's load
        reports are driven by it; a backend that never calls it is reported once a
        heartbeat."""
        ...

    async def start_kv_events(self, publisher: KvEventPublisher) -> Stoppable | None:
        """Start handing the engine's KV-cache events to `publisher` (None: the engine
        publishes none, e.g. prefix caching off). Stopped before the worker deregisters."""
        ...

    async def stop(self) -> None:
        """Release the engine, after requests in flight drained. Also called after a
        failed or interrupted `start`."""
        ...
