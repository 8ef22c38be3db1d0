"""Which models the frontend serves, and through which engine clients.

`ModelManager` is fed by plain method calls: `add_instance(card, ...)` when a worker
registers a model card, `remove_instance(instance_id)` when its card goes away. A model
appears with its first worker and disappears with its last. Where the events come from
(a NATS watcher in production, a test directly) is not its concern, so it is tested
without a broker.

Per model it keeps the preprocessor (tokenizer loaded once, from the first card) and one
`EndpointClient` per worker endpoint (namespace/component/endpoint); the client of the
aggregated or decode endpoint serves requests, wrapped for disaggregated serving when the
model also has prefill workers.

It also tells waiters when anything that decides "can this model take a request now"
changes (an instance registered, left, or its endpoint's ready set moved), so a request
that arrives while a model has no ready worker waits on that signal (`wait_for_workers`)
instead of polling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.frontend.engine.client import EndpointClient, EngineClient
from dynamo.frontend.engine.disagg import (
    DEFAULT_PREFILL_TIMEOUT_S,
    DecisionHook,
    DisaggregatedEngineClient,
    FallbackHook,
)
from dynamo.frontend.engine.prefill_policy import DisaggSettings
from dynamo.frontend.preprocess.preprocessor import Preprocessor
from dynamo.llm.protocols import ModelCard, WorkerType

log = logging.getLogger(__name__)

EndpointKey = tuple[str, str, str]  # (namespace, component, endpoint)

# Builds the engine client of one worker endpoint, from the card of its first instance.
EngineClientFactory = Callable[[ModelCard], Awaitable[EndpointClient]]
# A local tokenizer directory, or an async function that fetches one (called only for the
# first instance of a model, so later instances cost no download).
TokenizerSource = str | Path | Callable[[], Awaitable[Path]]
PreprocessorLoader = Callable[[ModelCard, Path], Preprocessor]
# Builds the engine of a model served by prefill and decode workers: (prefill, decode).
DisaggregatedFactory = Callable[[EndpointClient, EndpointClient], DisaggregatedEngineClient]


def endpoint_key(card: ModelCard) -> EndpointKey:
    return (card.namespace, card.component, card.endpoint)


@dataclass
class WorkerEndpoint:
    """One endpoint of a model's workers and the client that reaches its instances."""

    key: EndpointKey
    worker_type: WorkerType
    client: EndpointClient
    instance_ids: set[int] = field(default_factory=set)


@dataclass
class ServedModel:
    """A model as the HTTP layer sees it."""

    name: str
    preprocessor: Preprocessor
    created: int = field(default_factory=lambda: int(time.time()))
    cards: dict[int, ModelCard] = field(default_factory=dict)  # by instance id
    endpoints: dict[EndpointKey, WorkerEndpoint] = field(default_factory=dict)
    engine: EngineClient | None = None  # where requests go; None: only prefill workers

    @property
    def card(self) -> ModelCard:
        """A representative card (the earliest registered instance still present)."""
        return next(iter(self.cards.values()))

    def has_workers(self) -> bool:
        """Whether a request could be placed right now."""
        return self.engine is not None and bool(self.engine.instance_ids())


@dataclass(eq=False)
class ModelManager:
    """The registry of served models; all mutations go through its methods."""

    load_preprocessor: PreprocessorLoader = Preprocessor.from_dir
    on_prefill_fallback: FallbackHook | None = None
    prefill_timeout_s: float | None = DEFAULT_PREFILL_TIMEOUT_S
    disagg: DisaggSettings = field(default_factory=DisaggSettings)
    on_prefill_decision: DecisionHook | None = None
    _models: dict[str, ServedModel] = field(default_factory=dict, init=False)
    _instance_models: dict[int, set[str]] = field(default_factory=dict, init=False)  # id -> names
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, init=False)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def _disaggregated(
        self, prefill: EndpointClient, decode: EndpointClient
    ) -> DisaggregatedEngineClient:
        """The engine of a model with both prefill and decode workers."""
        return DisaggregatedEngineClient(
            prefill,
            decode,
            self.on_prefill_fallback,
            prefill_timeout_s=self.prefill_timeout_s,
            settings=self.disagg,
            on_decision=self.on_prefill_decision,
        )

    # ------------------------------------------------------------------ queries

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def models(self) -> list[ServedModel]:
        return list(self._models.values())

    def __contains__(self, name: object) -> bool:
        return name in self._models

    async def wait_for_workers(self, name: str, timeout: float) -> ServedModel | None:
        """`name` as registered once a worker can take its requests, waiting up to
        `timeout` seconds for one (a worker restarting, a late lease heartbeat, the first
        instance of an endpoint still being discovered); None if none became ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            model = self._models.get(name)
            if model is not None and model.has_workers():
                return model
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return None

    # ------------------------------------------------------------------ events

    async def add_instance(
        self,
        card: ModelCard,
        tokenizer: TokenizerSource,
        engine_client_factory: EngineClientFactory,
    ) -> ServedModel:
        """Register one worker instance of `card.name`. Idempotent per instance id (a
        re-put card only refreshes the stored card)."""
        async with self._lock(card.name):
            model = self._models.get(card.name)
            if model is None:
                preprocessor = await self._preprocessor(card, tokenizer)
                model = ServedModel(name=card.name, preprocessor=preprocessor)
                self._models[card.name] = model
                log.info("model %s added (context length %d)", card.name, card.context_length)
            else:
                _warn_on_mismatch(model, card)
            try:
                await self._attach(model, card, engine_client_factory)
            except BaseException:
                if not model.cards:
                    self._models.pop(card.name, None)
                raise
            self._instance_models.setdefault(card.instance_id, set()).add(card.name)
            return model

    async def remove_instance(self, instance_id: int, model_name: str | None = None) -> list[str]:
        """Forget an instance (of one model, or of every model it served). Returns the
        names of models that disappeared because it was their last worker."""
        names = sorted(self._instance_models.get(instance_id, set()))
        if model_name is not None:
            names = [n for n in names if n == model_name]
        removed = []
        for name in names:
            async with self._lock(name):
                if await self._detach(name, instance_id):
                    removed.append(name)
        return removed

    async def close(self) -> None:
        """Close every engine client (frontend shutdown)."""
        for model in list(self._models.values()):
            for endpoint in model.endpoints.values():
                await _close_quietly(endpoint.client)
        self._models.clear()
        self._instance_models.clear()
        self._notify()

    # ------------------------------------------------------------------ internals

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _notify(self) -> None:
        """Wake every `wait_for_workers` (each re-checks and waits on a fresh event)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _preprocessor(self, card: ModelCard, tokenizer: TokenizerSource) -> Preprocessor:
        directory = Path(await tokenizer()) if callable(tokenizer) else Path(tokenizer)
        return await asyncio.to_thread(self.load_preprocessor, card, directory)

    async def _attach(
        self, model: ServedModel, card: ModelCard, factory: EngineClientFactory
    ) -> None:
        key = endpoint_key(card)
        endpoint = model.endpoints.get(key)
        if endpoint is None:
            client = await factory(card)
            client.on_instances_changed(self._notify)
            endpoint = WorkerEndpoint(key=key, worker_type=card.worker_type, client=client)
            model.endpoints[key] = endpoint
        endpoint.instance_ids.add(card.instance_id)
        model.cards[card.instance_id] = card
        _compose_engine(model, self._disaggregated)
        self._notify()

    async def _detach(self, name: str, instance_id: int) -> bool:
        """Drop one instance of `name`; True when the model went away with it."""
        model = self._models.get(name)
        owned = self._instance_models.get(instance_id)
        if owned is not None:
            owned.discard(name)
            if not owned:
                del self._instance_models[instance_id]
        if model is None or model.cards.pop(instance_id, None) is None:
            return False
        for key, endpoint in list(model.endpoints.items()):
            endpoint.instance_ids.discard(instance_id)
            if not endpoint.instance_ids:
                del model.endpoints[key]
                await _close_quietly(endpoint.client)
        _compose_engine(model, self._disaggregated)
        gone = not model.cards
        if gone:
            del self._models[name]
            log.info("model %s removed: its last worker is gone", name)
        self._notify()
        return gone


def _compose_engine(model: ServedModel, disaggregated: DisaggregatedFactory) -> None:
    """Pick the client requests go to: decode/aggregated workers, with prefill workers in
    front of them when the model has both."""
    serving = [e for e in model.endpoints.values() if e.worker_type is not WorkerType.PREFILL]
    prefill = [e for e in model.endpoints.values() if e.worker_type is WorkerType.PREFILL]
    if not serving:
        model.engine = None
        return
    decode = serving[0].client
    if prefill:
        current = model.engine
        if isinstance(current, DisaggregatedEngineClient) and (
            current.prefill is prefill[0].client and current.decode is decode
        ):
            return
        model.engine = disaggregated(prefill[0].client, decode)
    else:
        model.engine = decode


def _warn_on_mismatch(model: ServedModel, card: ModelCard) -> None:
    first = model.card if model.cards else None
    if first is None:
        return
    if (
        first.tokenizer_digest
        and card.tokenizer_digest
        and first.tokenizer_digest != card.tokenizer_digest
    ):
        log.warning(
            "instance %d of %s has a different tokenizer (digest %s, serving %s); "
            "requests are tokenized with the first one",
            card.instance_id,
            card.name,
            card.tokenizer_digest,
            first.tokenizer_digest,
        )
    if first.context_length and card.context_length and first.context_length != card.context_length:
        log.warning(
            "instance %d of %s has context length %d, the model is served with %d",
            card.instance_id,
            card.name,
            card.context_length,
            first.context_length,
        )


async def _close_quietly(client: EndpointClient) -> None:
    try:
        await client.close()
    except Exception as exc:  # a broken client must not stop the others from closing
        log.warning("closing an engine client failed: %s", exc)
