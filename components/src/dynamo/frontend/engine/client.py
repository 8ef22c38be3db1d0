"""How the frontend talks to an engine: the `EngineClient` interface and its
implementation over the runtime.

`generate(request)` is an async generator of `LLMEngineOutput`s; closing it early (or
cancelling the task iterating it) cancels the request on the worker. The HTTP layer only
sees this interface and the exceptions of `errors.py`, never the transport's own errors.

`RuntimeEngineClient` serves one worker endpoint over `dynamo.runtime.Client` (NATS). It
is the one layer that decides where a request goes *again*: every placement, the first
one, a re-placement after a worker vanished before its first output, and a migration
mid-stream, asks the endpoint's `Router` and sends with `Client.direct`. The runtime
itself never retries. (`dynamo.testing.engines.InMemoryEngineClient` is the in-process
stand-in the HTTP tests use.) What a lost or refusing worker means for the request
(place it again, migrate it, fail it) is `request_legs.py`'s `RequestLegs`.

No request waits forever: a worker that dies is noticed through its lease, and one that
holds its lease but stops answering a request is caught by the `StreamDeadlines` (first
output, then between outputs); both count as losing the worker. A request the router
refuses because every worker is busy waits in the endpoint's `BusyQueue` (when it has
one) for room, in priority order, up to the queue's deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

from dynamo.frontend.engine.busy_queue import BusyQueue
from dynamo.frontend.engine.errors import (
    EngineFailedError,
    EngineOverloadedError,
    EngineUnavailableError,
    engine_error,
    lost_message,
)
from dynamo.frontend.engine.request_legs import RequestLegs
from dynamo.llm.protocols import LLMEngineOutput, PreprocessedRequest
from dynamo.llm.router import AllWorkersBusyError, Router
from dynamo.runtime import (
    Client,
    DynamoRuntimeError,
    InstanceGoneError,
    InstanceOverloadedError,
    ResponseStream,
    StreamTimeoutError,
)

log = logging.getLogger(__name__)

InstancesChanged = Callable[[], None]
"""Called with no arguments whenever an endpoint's set of ready instances changes."""

MigrationHook = Callable[[str], None]
"""Called with the model name each time a request is migrated to another worker."""

RoutedHook = Callable[[str, int, str, int | None], None]
"""Called after every placement the router made: model name, chosen instance, placement
kind (`PLACEMENT_*`) and the prompt blocks the router expects cached there (None when the
router does not estimate them). Feeds the frontend's router-decision series, the only
place where an operator sees where requests went and why."""

ComponentRoutedHook = Callable[[str, str, int, str, int | None], None]
"""A `RoutedHook` that also takes the worker component first (`backend`, `prefill`, ...):
what the frontend gives its card watcher, which binds each endpoint's component."""

PLACEMENT_NEW = "new"
"""A request's first placement."""
PLACEMENT_RETRY = "retry"
"""Placed again: its worker was lost or refused before any output."""
PLACEMENT_MIGRATION = "migration"
"""Continued on another worker after tokens had streamed."""

DEFAULT_FIRST_TOKEN_TIMEOUT_S = 300.0
"""Generous: a long prompt's prefill on a big model, queued behind others under load."""
DEFAULT_INTER_TOKEN_TIMEOUT_S = 60.0
"""No healthy engine goes a minute between two outputs of a running request."""
DEFAULT_ACCEPT_TIMEOUT_S = 15.0
"""A worker confirms a request as it reaches the handler, one event-loop turn later, and
before any compute: 15 s of silence means the request was lost on its way (a NATS node
failing while routing it) or the worker is frozen, not that it is slow."""


@dataclass(frozen=True)
class StreamDeadlines:
    """How long a worker may stay silent on a request before it counts as lost: until the
    first output of each placement, and between two outputs. None disables a deadline
    (the request then waits as long as the worker holds its lease).

    A worker past a deadline is treated as a worker that died: the request is cancelled
    there, then placed again (nothing streamed yet), migrated (tokens streamed and
    migrations left), or failed with a clear error, never left hanging."""

    first_token_s: float | None = DEFAULT_FIRST_TOKEN_TIMEOUT_S
    inter_token_s: float | None = DEFAULT_INTER_TOKEN_TIMEOUT_S
    accept_s: float | None = DEFAULT_ACCEPT_TIMEOUT_S

    def __post_init__(self) -> None:
        _check_deadline("first_token_s", self.first_token_s)
        _check_deadline("inter_token_s", self.inter_token_s)
        _check_deadline("accept_s", self.accept_s)

    @classmethod
    def from_seconds(
        cls, first_token_s: float, inter_token_s: float, accept_s: float = DEFAULT_ACCEPT_TIMEOUT_S
    ) -> StreamDeadlines:
        """From command-line values, where 0 disables a deadline."""
        return cls(first_token_s or None, inter_token_s or None, accept_s or None)


def _check_deadline(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be > 0 or None (no deadline), got {value}")


class EngineClient(Protocol):
    """Where a model's requests go: one worker endpoint, or a composition of several
    (prefill in front of decode)."""

    def generate(self, request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        """Stream the engine's outputs; `aclose()` before the end cancels on the worker."""
        ...

    def instance_ids(self) -> list[int]:
        """The workers that could take a request now (empty: 503)."""
        ...

    async def close(self) -> None: ...


class EndpointClient(EngineClient, Protocol):
    """The engine client of one worker endpoint, placing requests through its router."""

    @property
    def router(self) -> Router: ...

    def on_instances_changed(self, listener: InstancesChanged) -> None:
        """Call `listener()` whenever the endpoint's ready instances change."""
        ...


class RuntimeEngineClient:
    """`EndpointClient` over the runtime `Client` of one model endpoint.

    A request whose worker is lost before the first output is re-placed on another
    instance (nothing was streamed yet, so the client cannot tell). A worker lost after
    that is survived by *migration*, up to `migration_limit` times (the workers'
    `--migration-limit`, advertised on their model card): the request continues on another
    instance with the tokens generated so far appended to the prompt, so the client sees
    one uninterrupted stream. With no migrations left a lost worker is an error. "Lost"
    means its lease expired, it had no responder, it shut down before finishing, or it
    missed a `StreamDeadlines` deadline. An instance a request was lost on is not offered
    to the router again for that request, whatever the router prefers (a KV router would
    otherwise pick the same dead worker's cached prefix every time).

    "No responders" is the exception: nothing reached the worker, and a live worker
    answers it while it reconnects to NATS (losing a node of a NATS cluster). For up to
    one lease TTL (after which a dead worker's key has expired) such a request is neither
    charged a placement nor kept off that worker, and when every ready instance is left
    out after such an answer (`Client.routable_ids`), it waits for the first to be
    probed again instead of failing with a 503. Not with `wait_for_unreachable=False`
    (the prefill leg of a disaggregated request, which has a better way out than
    waiting: the decode worker prefills itself).

    `close()` while requests are in flight lets them finish first: the model registry
    closes an endpoint's client when its last model card goes, which is also the first
    step of that worker's graceful drain, and while the runtime `Client` stays open it
    still reports the instance's loss to the streams (a closed `Client` fails them).
    """

    def __init__(
        self,
        client: Client,
        router: Router,
        *,
        migration_limit: int = 0,
        deadlines: StreamDeadlines | None = None,
        on_migration: MigrationHook | None = None,
        on_routed: RoutedHook | None = None,
        wait_for_unreachable: bool = True,
        busy_queue: BusyQueue | None = None,
    ) -> None:
        self._client = client
        self.busy_queue = busy_queue
        self.wait_for_unreachable = wait_for_unreachable
        self._router = router
        self.migration_limit = max(0, migration_limit)
        self.deadlines = deadlines if deadlines is not None else StreamDeadlines()
        self._on_migration = on_migration
        self._on_routed = on_routed
        self.migrations = 0  # performed, for metrics and tests
        self._active = 0  # generate() calls in flight
        self._closing = False
        self._released = False
        self._release_task: asyncio.Task[None] | None = None

    @property
    def router(self) -> Router:
        return self._router

    def instance_ids(self) -> list[int]:
        return self._client.instance_ids()

    def on_instances_changed(self, listener: InstancesChanged) -> None:
        self._client.add_listener(lambda _ready: listener())

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        if self._closing:
            raise EngineUnavailableError(f"the workers of {request.model} are gone")
        self._active += 1
        try:
            patience = self._client.lease_ttl if self.wait_for_unreachable else 0.0
            legs = RequestLegs(request, self.migration_limit, unreachable_patience_s=patience)
            while True:
                target = await self._choose(
                    legs.leg, legs.failed, resuming=legs.resuming, lost=legs.lost
                )
                self._routed(legs, target)
                # The router may have booked the request on `target`: from here on, every
                # way out (including encoding the request) ends in `on_finished`.
                stream: ResponseStream[LLMEngineOutput] | None = None
                booked = legs.leg.request_id  # a lost leg's successor may get another id
                try:
                    stream = self._open(legs.leg, target)
                    already = len(legs.generated)
                    async for output in stream:
                        if legs.record(output, already):
                            self._router.on_first_output(booked, output)
                        yield output
                    return
                except (InstanceGoneError, StreamTimeoutError) as exc:
                    if legs.lost_on(target, exc):
                        self._migrated(request.model)
                except InstanceOverloadedError as exc:
                    legs.refused_by(target, exc)
                except DynamoRuntimeError as exc:
                    raise engine_error(exc, resuming=legs.resuming) from exc
                finally:
                    if stream is not None:
                        await stream.aclose()
                    self._router.on_finished(booked)
        finally:
            self._active -= 1
            if self._closing and not self._active:
                self._release_soon()

    async def _choose(
        self,
        request: PreprocessedRequest,
        failed: set[int],
        *,
        resuming: bool,
        lost: DynamoRuntimeError | None,
    ) -> int:
        """Ask the router where `request` goes among the routable instances it was not
        lost on (waiting, up to one lease TTL, while the only ones left are paused after a
        "no responders")."""
        candidates = [i for i in self._client.routable_ids() if i not in failed]
        if (
            not candidates
            and self.wait_for_unreachable
            and any(i not in failed for i in self._client.instance_ids())
        ):
            await self._client.wait_routable(self._client.lease_ttl, excluding=failed)
            candidates = [i for i in self._client.routable_ids() if i not in failed]
        if not candidates:
            if resuming:
                raise EngineFailedError(
                    f"worker lost and no other instance of {request.model} to continue on"
                    + (f" ({lost})" if lost is not None else "")
                )
            if isinstance(lost, StreamTimeoutError):  # instances exist, none answered
                raise EngineFailedError(lost_message(lost))
            if isinstance(lost, InstanceOverloadedError):  # instances exist, all refused
                raise EngineOverloadedError(f"every instance of {request.model} refused: {lost}")
            raise EngineUnavailableError(f"no instances serve model {request.model}")
        queue = None if resuming else self.busy_queue
        if queue is not None and queue.depth:  # others wait for room: wait behind them
            return await self._wait_for_room(queue, request, failed)
        try:
            return await self._router.select(request, candidates)
        except AllWorkersBusyError as exc:
            if resuming:
                raise EngineFailedError(f"worker lost and every other one is busy: {exc}") from exc
            if queue is None:
                raise EngineOverloadedError(str(exc)) from exc
        return await self._wait_for_room(queue, request, failed)

    async def _wait_for_room(
        self, queue: BusyQueue, request: PreprocessedRequest, failed: set[int]
    ) -> int:
        return await queue.wait_for_room(
            request.model, request.priority, lambda: self._select_again(request, failed)
        )

    async def _select_again(self, request: PreprocessedRequest, failed: set[int]) -> int:
        """A queued request's turn: ask the router among the instances routable now."""
        candidates = [i for i in self._client.routable_ids() if i not in failed]
        if not candidates:
            raise EngineUnavailableError(f"no instances serve model {request.model}")
        return await self._router.select(request, candidates)

    def _open(self, request: PreprocessedRequest, target: int) -> ResponseStream[LLMEngineOutput]:
        """The stream of `request` to `target` (nothing is sent until it is iterated)."""
        return self._client.direct(
            request,
            target,
            response_type=LLMEngineOutput,
            request_id=request.request_id,
            first_item_timeout=self.deadlines.first_token_s,
            item_timeout=self.deadlines.inter_token_s,
            accept_timeout=self.deadlines.accept_s,
        )

    def _routed(self, legs: RequestLegs, target: int) -> None:
        """Report the placement just made (see `RoutedHook`)."""
        if self._on_routed is None:
            return
        if legs.resuming:
            kind = PLACEMENT_MIGRATION
        elif legs.lost is not None:
            kind = PLACEMENT_RETRY
        else:
            kind = PLACEMENT_NEW
        routing = legs.leg.routing
        overlap = routing.overlap_blocks if routing is not None else None
        self._on_routed(legs.request.model, target, kind, overlap)

    def _migrated(self, model: str) -> None:
        self.migrations += 1
        if self._on_migration is not None:
            self._on_migration(model)

    async def close(self) -> None:
        """Release the router and the runtime client now, or, with requests in flight,
        when the last of them ends (see the class docstring); new requests are refused
        (503) from now on."""
        self._closing = True
        if not self._active:
            await self._release()

    def _release_soon(self) -> None:
        """`close()` came while requests were in flight and the last one just ended."""
        if self._release_task is None:
            self._release_task = asyncio.get_running_loop().create_task(self._release_quietly())

    async def _release_quietly(self) -> None:
        try:
            await self._release()
        except Exception:  # nobody awaits this task: a failure is only worth a log line
            log.exception("releasing the engine client of a closed endpoint failed")

    async def _release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            await self._router.close()
        finally:
            await self._client.close()
