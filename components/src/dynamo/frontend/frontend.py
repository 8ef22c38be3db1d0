"""Glue between the distributed runtime (NATS) and the frontend's own parts.

This is the only frontend module that connects to NATS and watches model cards;
everything else is tested without a broker. It turns model-card events
(`dynamo.llm.model_card.ModelCardWatcher`) into `ModelManager` calls (fetching each
model's tokenizer files once, `fetch_tokenizer_files`), builds one `RuntimeEngineClient`
(with the configured `Router`) per worker endpoint, and tells each endpoint's router of
the workers that come and go. A card that fails to load (its tokenizer files are not in
the object store yet after a broker restart, ...) is tried again with backoff
(`card_retry.CardRetries`: 0.5 s doubling to 10 s, shortest again after a reconnect)
for as long as it is registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.frontend.admission import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_WAITING, AdmissionLimits
from dynamo.frontend.card_retry import CardRetries
from dynamo.frontend.chat_parsers import ChatParsingOptions
from dynamo.frontend.disagg import DEFAULT_PREFILL_TIMEOUT_S
from dynamo.frontend.engine_client import (
    DEFAULT_ACCEPT_TIMEOUT_S,
    DEFAULT_FIRST_TOKEN_TIMEOUT_S,
    DEFAULT_INTER_TOKEN_TIMEOUT_S,
    ComponentRoutedHook,
    EndpointClient,
    MigrationHook,
    RuntimeEngineClient,
    StreamDeadlines,
)
from dynamo.frontend.http_listener import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    ConnectionTimeouts,
    share_port_across_processes,
)
from dynamo.frontend.http_server import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_WORKER_WAIT_S,
    DEFAULT_WRITE_TIMEOUT_S,
    HttpService,
)
from dynamo.frontend.http_workers import HttpWorkerSlot
from dynamo.frontend.metrics import FrontendMetrics
from dynamo.frontend.model_registry import ModelManager, endpoint_key
from dynamo.frontend.preprocessor import Preprocessor
from dynamo.frontend.routing import RouterFactory, RouterMode, make_router_factory
from dynamo.llm.kv_router.anticipation import CachePrediction
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.replica_sync import ReplicaSyncSettings
from dynamo.llm.kv_router.scheduler import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.llm.model_card import (
    FETCH_TIMEOUT_S,
    CardAdded,
    CardEvent,
    CardRemoved,
    ModelCardWatcher,
    fetch_tokenizer_files,
)
from dynamo.llm.protocols import ModelCard, WorkerType
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


CARD_APPLY_TIMEOUT_S = 2 * FETCH_TIMEOUT_S
"""Longest one card event may take to apply (tokenizer fetch, tokenizer load, router set-up).
Events are applied in order, so without a bound one stalled card would hold back every
later card of every model; past it the card is retried like any other that failed."""

FIRST_CARDS_WAIT_S = 30.0
"""Longest a frontend waits for the cards registered when it starts before it listens.
A process that listened first would answer 404 for models it has not loaded yet: a child
started again under `--http-workers` shares its port with a sibling that serves them, so
the kernel hands it clients at once. Past the bound it listens anyway (and says so)."""


class ModelCardSync:
    """Keeps a `ModelManager` in step with the model cards workers register in NATS."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        manager: ModelManager,
        router_factory: RouterFactory,
        tokenizer_cache: Path,
        *,
        deadlines: StreamDeadlines | None = None,
        on_migration: MigrationHook | None = None,
        on_routed: ComponentRoutedHook | None = None,
        retries: CardRetries | None = None,
        apply_timeout_s: float = CARD_APPLY_TIMEOUT_S,
    ) -> None:
        self._runtime = runtime
        self.apply_timeout_s = apply_timeout_s
        self._manager = manager
        self._router_factory = router_factory
        self._cache = tokenizer_cache
        self._deadlines = deadlines
        self._on_migration = on_migration
        self._on_routed = on_routed
        self.retries = retries or CardRetries()
        self.synced = asyncio.Event()
        """Set once the cards registered when `run` started are applied (or failed and
        scheduled for a retry)."""

    async def run(self, namespace: str) -> None:
        """Apply card events until cancelled. Events are applied in order (an instance's
        removal must not overtake its addition), and so are retries of cards that failed
        to load, while their card is still registered."""
        watcher = await ModelCardWatcher(self._runtime, namespace).start()
        self._runtime.add_reconnect_listener(self.retries.hurry)
        events = aiter(watcher)
        first_cards = watcher.pending
        if first_cards == 0:
            self.synced.set()
        next_event: asyncio.Future[CardEvent] | None = None
        try:
            while True:
                if next_event is None:
                    next_event = asyncio.ensure_future(anext(events))
                await asyncio.wait({next_event}, timeout=self.retries.seconds_until_next())
                if next_event.done():
                    event, next_event = next_event.result(), None
                    await self.apply_or_retry(event)
                    first_cards -= 1
                    if first_cards == 0:
                        self.synced.set()
                for card in self.retries.due():
                    if card in watcher.cards:
                        await self.apply_or_retry(CardAdded(card))
                    else:  # removed or replaced since: its own event decides
                        self.retries.forget(card)
        finally:
            if next_event is not None:
                next_event.cancel()
            self._runtime.remove_reconnect_listener(self.retries.hurry)
            await watcher.close()

    async def apply_or_retry(self, event: CardEvent) -> None:
        """Apply one event within `apply_timeout_s`; a card that fails to load, or takes
        longer, is scheduled for another try."""
        deadline = asyncio.timeout(self.apply_timeout_s)
        try:
            async with deadline:
                await self.apply(event)
        except Exception as exc:
            if deadline.expired():
                self._failed(event, f"not applied within {self.apply_timeout_s:g}s")
            else:
                self._failed(event, str(exc) or type(exc).__name__)
        else:
            self.retries.forget(event.card)

    def _failed(self, event: CardEvent, why: str) -> None:
        if not isinstance(event, CardAdded):
            log.error("could not apply model card event %r: %s", event, why, exc_info=True)
            return
        pending = self.retries.failed(event.card)
        log.warning(
            "could not load model %s from instance %016x (attempt %d): %s; retrying in %.1fs",
            event.card.name,
            event.card.instance_id,
            pending.failures,
            why,
            self.retries.backoff.delay(pending.failures),
        )

    async def apply(self, event: CardEvent) -> None:
        card = event.card
        if isinstance(event, CardAdded):
            model = await self._manager.add_instance(
                card, self._tokenizer_source(card), self._engine_client
            )
            model.endpoints[endpoint_key(card)].client.router.update_card(card)
        elif isinstance(event, CardRemoved):
            model = self._manager.get(card.name)
            endpoint = model.endpoints.get(endpoint_key(card)) if model else None
            if endpoint is not None:
                endpoint.client.router.remove_worker(card.instance_id)
            await self._manager.remove_instance(card.instance_id, card.name)

    def _tokenizer_source(self, card: ModelCard) -> Callable[[], Awaitable[Path]]:
        """Fetches the tokenizer files only if the manager needs them (first instance)."""

        async def fetch() -> Path:
            return Path(await fetch_tokenizer_files(self._runtime, card, self._cache))

        return fetch

    async def _engine_client(self, card: ModelCard) -> EndpointClient:
        endpoint = (
            self._runtime.namespace(card.namespace)
            .component(card.component)
            .endpoint(card.endpoint)
        )
        client = await endpoint.client()
        try:
            router = await self._router_factory(card, client)
        except BaseException:  # failed or cancelled (the apply timeout): nothing leaks
            await client.close()
            raise
        return RuntimeEngineClient(
            client,
            router,
            migration_limit=card.migration_limit,
            deadlines=self._deadlines,
            on_migration=self._on_migration,
            on_routed=(
                functools.partial(self._on_routed, card.component)
                if self._on_routed is not None
                else None
            ),
            # A prefill leg that finds no reachable worker falls back to a local prefill
            # at once rather than wait for one (see `DisaggregatedEngineClient`).
            wait_for_unreachable=card.worker_type is not WorkerType.PREFILL,
        )


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
