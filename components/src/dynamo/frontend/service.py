"""The frontend process wired together: its settings (`FrontendConfig`) and `run_frontend`,
which connects to NATS, keeps the model registry in step with the cards
(`models.card_sync.ModelCardSync`) and serves HTTP until told to stop.

This and `models.card_sync` are the frontend modules that connect to NATS and watch
model cards; everything else is tested without a broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.frontend.engine.client import (
    DEFAULT_ACCEPT_TIMEOUT_S,
    DEFAULT_FIRST_TOKEN_TIMEOUT_S,
    DEFAULT_INTER_TOKEN_TIMEOUT_S,
    StreamDeadlines,
)
from dynamo.frontend.engine.disagg import DEFAULT_PREFILL_TIMEOUT_S
from dynamo.frontend.engine.routing import RouterMode, make_router_factory
from dynamo.frontend.http.admission import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MAX_WAITING,
    AdmissionLimits,
)
from dynamo.frontend.http.listener import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    ConnectionTimeouts,
    share_port_across_processes,
)
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.server import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_WORKER_WAIT_S,
    DEFAULT_WRITE_TIMEOUT_S,
    HttpService,
)
from dynamo.frontend.http.workers import HttpWorkerSlot
from dynamo.frontend.models.card_sync import ModelCardSync
from dynamo.frontend.models.manager import ModelManager
from dynamo.frontend.parsing.chat_parsers import ChatParsingOptions
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.llm.kv_router.anticipation import CachePrediction
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.replica_sync import ReplicaSyncSettings
from dynamo.llm.kv_router.scheduler import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.nats_options import NatsConnectOptions

log = logging.getLogger(__name__)


def default_tokenizer_cache() -> Path:
    return Path.home() / ".cache" / "dynamo" / "frontend-tokenizers"


@dataclass(frozen=True)
class FrontendConfig:
    """Settings of one frontend process (the CLI flags)."""

    http_host: str = "0.0.0.0"
    http_port: int = 8000
    namespace: str = "dynamo"
    nats_server: str = "nats://127.0.0.1:4222"
    nats_options: NatsConnectOptions | None = None  # None: the NATS_* variables
    router_mode: RouterMode = RouterMode.ROUND_ROBIN
    kv_overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT
    router_temperature: float = 0.0
    busy_kv_usage: float | None = None  # kv mode: a worker this full is skipped (None: off)
    busy_waiting_requests: int | None = None  # kv mode: a worker with this queue is skipped
    kv_events: bool = True  # kv mode: False routes without KV events (approximate mode)
    router_ttl_s: float | None = None  # kv mode: how long routed blocks count unconfirmed
    router_replica_sync: bool = True  # kv mode: share bookings with other frontend replicas
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tokenizer_cache: Path | None = None
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    worker_wait_s: float = DEFAULT_WORKER_WAIT_S
    first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S  # 0: no deadline
    inter_token_timeout_s: float = DEFAULT_INTER_TOKEN_TIMEOUT_S  # 0: no deadline
    accept_timeout_s: float = DEFAULT_ACCEPT_TIMEOUT_S  # 0: no deadline
    # None or "": no authentication. Kept out of repr so that no log of the config shows it.
    api_key: str | None = field(default=None, repr=False)
    max_inflight_requests: int = DEFAULT_MAX_INFLIGHT  # per model
    max_waiting_requests: int = DEFAULT_MAX_WAITING  # per model, waiting for a worker
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # 0: a stream waits for its client
    return_spec_stats: bool = False  # speculation statistics in every response
    chat_template: str | None = None  # --chat-template: Jinja source replacing the model's
    chat_parsing: ChatParsingOptions = field(default_factory=ChatParsingOptions)
    # One of `--http-workers` processes (`http_workers.py`): the port is shared
    # (SO_REUSEPORT) and /metrics sums every process's files in `metrics_dir`.
    http_worker: HttpWorkerSlot | None = None
    metrics_dir: Path | None = None

    @property
    def shared_port(self) -> bool:
        return self.http_worker is not None

    @property
    def stream_deadlines(self) -> StreamDeadlines:
        return StreamDeadlines.from_seconds(
            self.first_token_timeout_s, self.inter_token_timeout_s, self.accept_timeout_s
        )


FIRST_CARDS_WAIT_S = 30.0
"""Longest a frontend waits for the cards registered when it starts before it listens.
A process that listened first would answer 404 for models it has not loaded yet: a child
started again under `--http-workers` shares its port with a sibling that serves them, so
the kernel hands it clients at once. Past the bound it listens anyway (and says so)."""


async def run_frontend(config: FrontendConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or forever): connect, watch cards, serve HTTP."""
    stop = stop or asyncio.Event()
    runtime = await DistributedRuntime.connect(
        config.nats_server, name="frontend", wait_for_server=30, options=config.nats_options
    )
    if config.shared_port:
        share_port_across_processes()
    metrics = FrontendMetrics(multiprocess_dir=config.metrics_dir)
    manager = ModelManager(
        load_preprocessor=functools.partial(
            Preprocessor.from_dir, chat_template=config.chat_template
        ),
        on_prefill_fallback=metrics.prefill_fallback,
        prefill_timeout_s=config.prefill_timeout_s,
    )
    service = HttpService(
        manager,
        metrics=metrics,
        host=config.http_host,
        port=config.http_port,
        max_request_bytes=config.max_request_bytes,
        worker_wait_s=config.worker_wait_s,
        api_key=config.api_key,
        admission=AdmissionLimits(config.max_inflight_requests, config.max_waiting_requests),
        timeouts=ConnectionTimeouts(config.keep_alive_timeout_s, config.header_timeout_s),
        write_timeout_s=config.write_timeout_s or None,
        return_spec_stats=config.return_spec_stats,
        chat_parsing=config.chat_parsing,
        http_worker=config.http_worker,
    )
    watcher: asyncio.Task[None] | None = None
    try:
        router_factory = make_router_factory(
            config.router_mode,
            runtime,
            kv_overlap_score_weight=config.kv_overlap_score_weight,
            router_temperature=config.router_temperature,
            busy=BusyThresholds(config.busy_kv_usage, config.busy_waiting_requests),
            prediction=CachePrediction(config.kv_events, config.router_ttl_s),
            replica_sync=ReplicaSyncSettings(enabled=config.router_replica_sync),
        )
        sync = ModelCardSync(
            runtime,
            manager,
            router_factory,
            config.tokenizer_cache or default_tokenizer_cache(),
            deadlines=config.stream_deadlines,
            on_migration=metrics.migration,
            on_routed=metrics.routed,
        )
        watcher = asyncio.create_task(sync.run(config.namespace))
        await _first_cards(sync, watcher)
        await service.start()
        await _wait_either(stop, watcher)
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
        await service.stop()
        await manager.close()
        await _close_runtime(runtime)


async def _first_cards(sync: ModelCardSync, watcher: asyncio.Task[None]) -> None:
    """Wait (at most FIRST_CARDS_WAIT_S) for the cards registered at start to be applied,
    so that the first request this process answers finds the models that already exist.
    A watcher that fails returns at once: `_wait_either` raises its error."""
    synced = asyncio.create_task(sync.synced.wait())
    try:
        done, _ = await asyncio.wait(
            {synced, watcher}, timeout=FIRST_CARDS_WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        synced.cancel()
    if not done:
        log.warning(
            "the models registered at start were not all loaded within %gs; "
            "listening anyway (requests for them get 404 until they are)",
            FIRST_CARDS_WAIT_S,
        )


async def _wait_either(stop: asyncio.Event, watcher: asyncio.Task[None]) -> None:
    """Return when asked to stop; raise if the card watcher died (the frontend would
    silently stop learning about workers otherwise)."""
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({stopper, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
        raise RuntimeError("model card watcher failed") from watcher.exception()


async def _close_runtime(runtime: DistributedRuntime) -> None:
    with contextlib.suppress(Exception):
        await runtime.shutdown(drain_timeout=0)
