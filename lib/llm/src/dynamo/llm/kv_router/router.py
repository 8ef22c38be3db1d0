"""`KvRouter`: the `dynamo.llm.router.Router` the frontend holds, over a `KvScheduler`.

`KvScheduler` (`scheduler`) is the NATS-free core that scores workers and keeps the
books; `KvRouter` implements the `Router` protocol over it and is fed cache events,
worker cards and load metrics by whoever owns the subscriptions (injected async
iterables or direct calls), and owns those feeds' tasks and any `RouterAttachment` (e.g.
`nats_feed`'s subscriptions) until `close`. Kept apart from the scheduler because this
is life-cycle and plumbing (tasks, attachments, input dispatch), not cost or books;
`build_kv_router` assembles the two from a model card.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterable, Sequence
from typing import Any, Protocol

from dynamo.llm.kv_router.anticipation import CachePrediction
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.scheduler import KvScheduler
from dynamo.llm.kv_router.scheduler_defaults import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.llm.kv_router.tiers import TierWeights
from dynamo.llm.kv_router.worker_spec import KvWorkerSpec
from dynamo.llm.protocols import (
    LLMEngineOutput,
    LoadMetrics,
    ModelCard,
    PreprocessedRequest,
    RouterEvent,
    RoutingHints,
)
from dynamo.llm.router import PlacementPreview, Router
from dynamo.runtime.selection import RoundRobin

log = logging.getLogger(__name__)

RouterInput = RouterEvent | LoadMetrics | ModelCard
"""What a feed may carry: cache events, load reports, and worker cards (add/update)."""


class RouterAttachment(Protocol):
    """Something a router owns besides its feeds (e.g. the NATS subscriptions that feed
    it): closed with the router and shown in its debug view under `name`."""

    name: str

    async def close(self) -> None: ...

    def debug_state(self) -> dict[str, Any]: ...


class KvRouter(Router):
    """The KV-cache-aware `Router`, over a `KvScheduler`.

    Event plumbing is injected: call `apply_event` / `update_load` / `update_card` /
    `remove_worker` from subscriptions, or hand async iterables to `feed`, whose
    consuming tasks `close` cancels.
    """

    def __init__(self, scheduler: KvScheduler) -> None:
        self.scheduler = scheduler
        self._no_tokens = RoundRobin()  # a request without tokens has no prefix to match
        self._feeds: set[asyncio.Task[None]] = set()
        self._attachments: list[RouterAttachment] = []
        self._closed = False

    # ------------------------------------------------------------------ Router protocol

    async def select(self, request: PreprocessedRequest, instance_ids: Sequence[int]) -> int:
        """Score the candidates, book the request on the cheapest, and record the
        choice in `request.routing`."""
        if not request.token_ids:
            return self._no_tokens.pick(self.scheduler.not_busy(instance_ids))
        decision = self.scheduler.schedule(request.request_id, request.token_ids, instance_ids)
        routing = request.routing if request.routing is not None else RoutingHints()
        routing.backend_instance_id = decision.worker_id
        routing.overlap_blocks = decision.overlap_blocks
        request.routing = routing
        log.debug(
            "request %s -> worker %d (overlap %d/%d blocks)",
            request.request_id,
            decision.worker_id,
            decision.overlap_blocks,
            decision.request_blocks,
        )
        return decision.worker_id

    def preview(
        self, request: PreprocessedRequest, instance_ids: Sequence[int]
    ) -> PlacementPreview | None:
        """The scheduler's choice without booking (None for a request without tokens,
        which `select` places round-robin)."""
        if not request.token_ids:
            return None
        return self.scheduler.preview(request.token_ids, instance_ids)

    def on_first_output(self, request_id: str, output: LLMEngineOutput) -> None:
        self.scheduler.mark_prefill_completed(request_id, len(output.token_ids))

    def on_finished(self, request_id: str) -> None:
        self.scheduler.free(request_id)

    async def close(self) -> None:
        self._closed = True
        attachments, self._attachments = self._attachments, []
        for attachment in attachments:
            try:
                await attachment.close()
            except Exception:
                log.exception("kv router: closing %s failed", attachment.name)
        feeds = list(self._feeds)
        for task in feeds:
            task.cancel()
        await asyncio.gather(*feeds, return_exceptions=True)
        self._feeds.clear()

    # ------------------------------------------------------------------ ownership and views

    def attach(self, attachment: RouterAttachment) -> None:
        """Own `attachment`: it is closed by `close` and reported by `debug_state`."""
        if self._closed:
            raise RuntimeError("router is closed")
        self._attachments.append(attachment)

    def debug_state(self) -> dict[str, Any]:
        """The scheduler's view plus each attachment's (e.g. the event feed's counters)."""
        state = self.scheduler.debug_state()
        for attachment in self._attachments:
            state[attachment.name] = attachment.debug_state()
        return state

    # ------------------------------------------------------------------ inputs

    def apply_event(self, event: RouterEvent) -> None:
        self.scheduler.apply_event(event)

    def update_load(self, metrics: LoadMetrics) -> None:
        self.scheduler.update_load(metrics)

    def update_card(self, card: ModelCard) -> None:
        self.scheduler.update_worker(KvWorkerSpec.from_card(card, self.scheduler.block_size))

    def remove_worker(self, worker_id: int) -> None:
        self.scheduler.remove_worker(worker_id)

    def handle(self, item: RouterInput) -> None:
        """Dispatch one input by type (what a feed delivers)."""
        if isinstance(item, RouterEvent):
            self.apply_event(item)
        elif isinstance(item, LoadMetrics):
            self.update_load(item)
        elif isinstance(item, ModelCard):
            self.update_card(item)
        else:
            raise TypeError(f"unsupported router input {type(item).__name__}")

    def feed(self, source: AsyncIterable[RouterInput]) -> asyncio.Task[None]:
        """Consume `source` in the background until it ends or `close` is called."""
        if self._closed:
            raise RuntimeError("router is closed")
        task = asyncio.create_task(self._consume(source), name="kv-router-feed")
        self._feeds.add(task)
        task.add_done_callback(self._feeds.discard)
        return task

    async def _consume(self, source: AsyncIterable[RouterInput]) -> None:
        """Apply items in order; one bad item is logged and skipped so a single
        malformed event cannot stop the router learning about caches."""
        async for item in source:
            try:
                self.handle(item)
            except Exception:
                log.exception("kv router: dropping input %r", type(item).__name__)


def build_kv_router(
    card: ModelCard,
    *,
    overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT,
    temperature: float = 0.0,
    sources: Sequence[AsyncIterable[RouterInput]] = (),
    rng: random.Random | None = None,
    busy: BusyThresholds | None = None,
    prediction: CachePrediction | None = None,
    tier_weights: TierWeights | None = None,
) -> KvRouter:
    """A `KvRouter` for the model of `card` (its block size; the card's worker is known
    at once). Must run inside an event loop when `sources` are given."""
    if card.kv_block_size <= 0:
        raise ValueError(f"model card of {card.name!r} has no kv_block_size")
    scheduler = KvScheduler(
        card.kv_block_size,
        overlap_score_weight=overlap_score_weight,
        temperature=temperature,
        rng=rng,
        busy=busy,
        prediction=prediction,
        tier_weights=tier_weights,
    )
    router = KvRouter(scheduler)
    router.update_card(card)
    for source in sources:
        router.feed(source)
    return router
