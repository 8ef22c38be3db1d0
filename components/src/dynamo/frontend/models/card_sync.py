"""The frontend's model registry kept in step with the model cards workers register.

`ModelCardSync` turns model-card events (`dynamo.llm.model_card.ModelCardWatcher`) into
`ModelManager` calls (fetching each model's tokenizer files once,
`fetch_tokenizer_files`), builds one `RuntimeEngineClient` (with the configured `Router`)
per worker endpoint, and tells each endpoint's router of the workers that come and go. A
card that fails to load (its tokenizer files are not in the object store yet after a
broker restart, ...) is tried again with backoff (`card_retry.CardRetries`: 0.5 s
doubling to 10 s, shortest again after a reconnect) for as long as it is registered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

from dynamo.frontend.engine.busy_queue import BusyQueue, BusyQueueSettings, QueueObserver
from dynamo.frontend.engine.client import (
    ComponentRoutedHook,
    EndpointClient,
    MigrationHook,
    RuntimeEngineClient,
    StreamDeadlines,
)
from dynamo.frontend.engine.routing import RouterFactory
from dynamo.frontend.models.card_retry import CardRetries
from dynamo.frontend.models.manager import ModelManager, endpoint_key
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

log = logging.getLogger(__name__)

CARD_APPLY_TIMEOUT_S = 2 * FETCH_TIMEOUT_S
"""Longest one card event may take to apply (tokenizer fetch, tokenizer load, router set-up).
Events are applied in order, so without a bound one stalled card would hold back every
later card of every model; past it the card is retried like any other that failed."""


@dataclass(eq=False)
class ModelCardSync:
    """Keeps a `ModelManager` in step with the model cards workers register in NATS."""

    runtime: DistributedRuntime
    manager: ModelManager
    router_factory: RouterFactory
    tokenizer_cache: Path
    _: KW_ONLY
    deadlines: StreamDeadlines | None = None
    on_migration: MigrationHook | None = None
    on_routed: ComponentRoutedHook | None = None
    # Each endpoint's queue for requests that find every worker busy (None: 503 at once).
    busy_queue: BusyQueueSettings | None = None
    queue_observer: QueueObserver | None = None
    retries: CardRetries = field(default_factory=CardRetries)
    apply_timeout_s: float = CARD_APPLY_TIMEOUT_S
    synced: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    """Set once the cards registered when `run` started are applied (or failed and
    scheduled for a retry)."""

    def __post_init__(self) -> None:
        # None given for `retries` stands for a fresh one (so does an empty one: falsy).
        self.retries = self.retries or CardRetries()

    async def run(self, namespace: str) -> None:
        """Apply card events until cancelled. Events are applied in order (an instance's
        removal must not overtake its addition), and so are retries of cards that failed
        to load, while their card is still registered."""
        watcher = await ModelCardWatcher(self.runtime, namespace).start()
        self.runtime.add_reconnect_listener(self.retries.hurry)
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
            self.runtime.remove_reconnect_listener(self.retries.hurry)
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
            model = await self.manager.add_instance(
                card, self._tokenizer_source(card), self._engine_client
            )
            model.endpoints[endpoint_key(card)].client.router.update_card(card)
        elif isinstance(event, CardRemoved):
            model = self.manager.get(card.name)
            endpoint = model.endpoints.get(endpoint_key(card)) if model else None
            if endpoint is not None:
                endpoint.client.router.remove_worker(card.instance_id)
            await self.manager.remove_instance(card.instance_id, card.name)

    def _tokenizer_source(self, card: ModelCard) -> Callable[[], Awaitable[Path]]:
        """Fetches the tokenizer files only if the manager needs them (first instance)."""

        async def fetch() -> Path:
            return Path(await fetch_tokenizer_files(self.runtime, card, self.tokenizer_cache))

        return fetch

    async def _engine_client(self, card: ModelCard) -> EndpointClient:
        endpoint = (
            self.runtime.namespace(card.namespace).component(card.component).endpoint(card.endpoint)
        )
        client = await endpoint.client()
        try:
            router = await self.router_factory(card, client)
        except BaseException:  # failed or cancelled (the apply timeout): nothing leaks
            await client.close()
            raise
        return RuntimeEngineClient(
            client,
            router,
            migration_limit=card.migration_limit,
            deadlines=self.deadlines,
            on_migration=self.on_migration,
            on_routed=(
                functools.partial(self.on_routed, card.component)
                if self.on_routed is not None
                else None
            ),
            # A prefill leg that finds no reachable worker falls back to a local prefill
            # at once rather than wait for one (see `DisaggregatedEngineClient`).
            wait_for_unreachable=card.worker_type is not WorkerType.PREFILL,
            busy_queue=self._busy_queue(card),
        )

    def _busy_queue(self, card: ModelCard) -> BusyQueue | None:
        """Requests queue for their decode (or aggregated) workers; a busy prefill pool is
        the disaggregated client's to handle (the decode worker prefills itself)."""
        settings = self.busy_queue
        if settings is None or not settings.enabled or card.worker_type is WorkerType.PREFILL:
            return None
        return BusyQueue(settings, self.queue_observer)
