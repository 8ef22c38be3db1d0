"""Worker selection: the `Router` protocol and the stateless routers.

A router picks which instance of a model's endpoint gets a request. It sees the
preprocessed request (token ids, so a KV-aware router can match cached prefixes) and the
instances currently alive, and is told when a request produced its first output and when
it finished, so a router that tracks load (active KV blocks, prefill tokens in flight)
can keep its books. Returning `None` leaves the choice to the transport's round-robin.

One router instance serves one model endpoint; `RouterFactory` builds them as models
appear (the KV router needs the model's block size and its workers' event subjects).
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from dynamo.llm.protocols import LLMEngineOutput, ModelCard, PreprocessedRequest

log = logging.getLogger(__name__)


class RouterMode(str, enum.Enum):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    KV = "kv"


@runtime_checkable
class Router(Protocol):
    """Chooses a worker instance per request and follows the request's lifetime."""

    async def select(self, request: PreprocessedRequest, instance_ids: list[int]) -> int | None:
        """The instance id to send `request` to, or None to let the client round-robin.

        `instance_ids` is non-empty. May record the decision (e.g. in
        `request.routing`) and its expected load until `on_finished`.
        """
        ...

    def on_first_output(self, request_id: str, output: LLMEngineOutput) -> None:
        """The first output of a request arrived (prefill done on its worker)."""
        ...

    def on_finished(self, request_id: str) -> None:
        """The request ended for any reason (finished, failed, cancelled). Called exactly
        once per `select` whose request was sent."""
        ...

    async def close(self) -> None:
        """Stop background work (event subscriptions)."""
        ...


class RoundRobinRouter:
    """Stateless: defers to the transport's own round-robin."""

    async def select(self, request: PreprocessedRequest, instance_ids: list[int]) -> int | None:
        return None

    def on_first_output(self, request_id: str, output: LLMEngineOutput) -> None:
        return None

    def on_finished(self, request_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


class RandomRouter(RoundRobinRouter):
    """Uniformly random instance per request."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    async def select(self, request: PreprocessedRequest, instance_ids: list[int]) -> int | None:
        return self._rng.choice(instance_ids)


# Builds the router of one model endpoint: (card of its first worker, transport client).
RouterFactory = Callable[[ModelCard, Any], Awaitable[Router]]


class RouterUnavailableError(RuntimeError):
    """The requested routing mode cannot be provided by this installation."""


def make_router_factory(
    mode: RouterMode,
    *,
    runtime: Any = None,
    kv_overlap_score_weight: float = 1.0,
    router_temperature: float = 0.0,
) -> RouterFactory:
    """The factory for `--router-mode`. Raises `RouterUnavailableError` for `kv` when the
    KV router module is not installed, so the CLI can refuse to start."""
    if mode is RouterMode.ROUND_ROBIN:

        async def round_robin(card: ModelCard, client: Any) -> Router:
            return RoundRobinRouter()

        return round_robin
    if mode is RouterMode.RANDOM:

        async def random_router(card: ModelCard, client: Any) -> Router:
            return RandomRouter()

        return random_router
    return _kv_router_factory(runtime, kv_overlap_score_weight, router_temperature)


def _kv_router_factory(runtime: Any, overlap_weight: float, temperature: float) -> RouterFactory:
    """Adapter to `dynamo.llm.kv_router.create_kv_router`: a KV router fed by the
    workers' KV-event stream and load reports over NATS. There is deliberately no
    fallback without events: a "kv" router that cannot see caches would route by load
    alone while claiming to chase cache hits."""
    try:
        from dynamo.llm.kv_router.nats_feed import create_kv_router
    except ImportError as exc:
        raise RouterUnavailableError(f"kv router not available: {exc}") from exc
    if runtime is None:
        raise RouterUnavailableError("kv router needs a NATS runtime for its event feed")

    async def kv(card: ModelCard, client: Any) -> Router:
        return await create_kv_router(
            runtime, card, client, overlap_score_weight=overlap_weight, temperature=temperature
        )

    return kv
