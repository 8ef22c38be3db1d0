"""Glue between the distributed runtime (NATS) and the frontend's own parts.

This is the only frontend module that connects to NATS and watches model cards;
everything else is tested without a broker. It turns model-card events
(`dynamo.llm.model_card.ModelCardWatcher`) into `ModelManager` calls (fetching each
model's tokenizer files once, `fetch_tokenizer_files`), builds one `RuntimeEngineClient`
(with the configured `Router`) per worker endpoint, and tells each endpoint's router of
the workers that come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from dynamo.frontend.disagg import DEFAULT_PREFILL_TIMEOUT_S
from dynamo.frontend.engine_client import EndpointClient, RuntimeEngineClient
from dynamo.frontend.http_server import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_WORKER_WAIT_S,
    HttpService,
)
from dynamo.frontend.metrics import FrontendMetrics
from dynamo.frontend.model_registry import ModelManager, endpoint_key
from dynamo.frontend.routing import RouterFactory, RouterMode, make_router_factory
from dynamo.llm.model_card import (
    CardAdded,
    CardEvent,
    CardRemoved,
    ModelCardWatcher,
    fetch_tokenizer_files,
)
from dynamo.llm.protocols import ModelCard
from dynamo.runtime import DistributedRuntime

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
    router_mode: RouterMode = RouterMode.ROUND_ROBIN
    kv_overlap_score_weight: float = 1.0
    router_temperature: float = 0.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tokenizer_cache: Path | None = None
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    worker_wait_s: float = DEFAULT_WORKER_WAIT_S


class ModelCardSync:
    """Keeps a `ModelManager` in step with the model cards workers register in NATS."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        manager: ModelManager,
        router_factory: RouterFactory,
        tokenizer_cache: Path,
    ) -> None:
        self._runtime = runtime
        self._manager = manager
        self._router_factory = router_factory
        self._cache = tokenizer_cache

    async def run(self, namespace: str) -> None:
        """Apply card events until cancelled. Events are applied in order (an instance's
        removal must not overtake its addition); a failing event is logged and skipped."""
        watcher = await ModelCardWatcher(self._runtime, namespace).start()
        try:
            async for event in watcher:
                try:
                    await self.apply(event)
                except Exception:
                    log.exception("could not apply model card event %r", event)
        finally:
            await watcher.close()

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
        router = await self._router_factory(card, client)
        return RuntimeEngineClient(client, router, migration_limit=card.migration_limit)


async def run_frontend(config: FrontendConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or forever): connect, watch cards, serve HTTP."""
    stop = stop or asyncio.Event()
    runtime = await DistributedRuntime.connect(
        config.nats_server, name="frontend", wait_for_server=30
    )
    metrics = FrontendMetrics()
    manager = ModelManager(
        on_prefill_fallback=metrics.prefill_fallback, prefill_timeout_s=config.prefill_timeout_s
    )
    service = HttpService(
        manager,
        metrics=metrics,
        host=config.http_host,
        port=config.http_port,
        max_request_bytes=config.max_request_bytes,
        worker_wait_s=config.worker_wait_s,
    )
    watcher: asyncio.Task[None] | None = None
    try:
        router_factory = make_router_factory(
            config.router_mode,
            runtime,
            kv_overlap_score_weight=config.kv_overlap_score_weight,
            router_temperature=config.router_temperature,
        )
        sync = ModelCardSync(
            runtime, manager, router_factory, config.tokenizer_cache or default_tokenizer_cache()
        )
        watcher = asyncio.create_task(sync.run(config.namespace))
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
