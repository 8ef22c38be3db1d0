"""Worker choice for LLM requests: the `Router` protocol and the stateless routers.

A router decides which instance of a model's worker endpoint serves each request. It is
the only place where that decision is made: the frontend's engine client asks it for
every placement (first send, re-placement after a worker vanished before its first
output, migration mid-stream) and sends there with the runtime's `Client.direct`.

It sees the preprocessed request (token ids, so a KV-aware router can match cached
prefixes) and the candidate instances, and it is told how each request it placed goes
(first output, end) and how the worker set changes (cards, departures), so a router that
tracks load can keep its books. Every hook but `select` has a no-op default: a stateless
router implements `select` alone.

One router serves one worker endpoint of one model. `dynamo.llm.kv_router.KvRouter` is
the KV-cache-aware one.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dynamo.llm.protocols import LLMEngineOutput, ModelCard, PreprocessedRequest
from dynamo.runtime.selection import RandomChoice, RoundRobin


class AllWorkersBusyError(Exception):
    """`select` refuses the request: every candidate is over its busy threshold (a router
    with load knowledge and thresholds set, e.g. the KV router's `--busy-kv-usage`).
    Nothing is booked; the frontend answers 503 with `Retry-After` instead of piling more
    work onto saturated workers."""


@dataclass(frozen=True, slots=True)
class PlacementPreview:
    """Where `select` would place a request now and what that worker holds, with nothing
    booked: what a disaggregated frontend reads to decide whether the decode worker
    prefills a prompt itself (`dynamo.frontend.engine.prefill_policy`)."""

    worker_id: int
    cached_tokens: int  # prompt tokens the worker is expected to reuse from its cache
    queued_prefill_tokens: int  # prompt tokens routed there whose prefill has not completed
    busy: bool = False  # every candidate is over its busy threshold


@runtime_checkable
class Router(Protocol):
    """Chooses a worker instance per request and follows the request's lifetime."""

    @abc.abstractmethod
    async def select(self, request: PreprocessedRequest, instance_ids: Sequence[int]) -> int:
        """The instance (one of `instance_ids`, never empty) to send `request` to.

        May record the decision (in `request.routing`) and book its expected load until
        `on_finished`. Raises `AllWorkersBusyError` (booking nothing) when it judges every
        candidate too busy to take more work.
        """

    def preview(
        self, request: PreprocessedRequest, instance_ids: Sequence[int]
    ) -> PlacementPreview | None:
        """Where `select` would place `request` among `instance_ids` (never empty), with
        nothing booked or recorded; None from a router that keeps no books."""
        return None

    def on_first_output(self, request_id: str, output: LLMEngineOutput) -> None:
        """The first output of a placed request arrived (its prefill is done)."""
        return None

    def on_finished(self, request_id: str) -> None:
        """A placed request ended for any reason (finished, failed, cancelled): called
        exactly once per `select` whose request was sent."""
        return None

    def update_card(self, card: ModelCard) -> None:
        """A worker of this endpoint registered or changed its model card."""
        return None

    def remove_worker(self, worker_id: int) -> None:
        """A worker of this endpoint is gone (its card was removed)."""
        return None

    def debug_state(self) -> dict[str, object]:
        """What the router believes, for `GET /debug/kv` (empty: it keeps no state)."""
        return {}

    async def close(self) -> None:
        """Stop background work (event subscriptions)."""
        return None


class RoundRobinRouter(Router):
    """Each request to the next candidate in turn."""

    def __init__(self) -> None:
        self._picker = RoundRobin()

    async def select(self, request: PreprocessedRequest, instance_ids: Sequence[int]) -> int:
        return self._picker.pick(instance_ids)


class RandomRouter(Router):
    """Each request to a uniformly random candidate."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._picker = RandomChoice(rng)

    async def select(self, request: PreprocessedRequest, instance_ids: Sequence[int]) -> int:
        return self._picker.pick(instance_ids)
