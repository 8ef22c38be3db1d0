"""How the frontend talks to an engine: the `EngineClient` interface and its
implementation over the runtime.

`generate(request)` is an async generator of `LLMEngineOutput`s; closing it early (or
cancelling the task iterating it) cancels the request on the worker. The HTTP layer only
sees this interface and the two exceptions below, never the transport's own errors.

`RuntimeEngineClient` serves one worker endpoint over `dynamo.runtime.Client` (NATS). It
is the one layer that decides where a request goes *again*: every placement, the first
one, a re-placement after a worker vanished before its first output, and a migration
mid-stream, asks the endpoint's `Router` and sends with `Client.direct`. The runtime
itself never retries. (`dynamo.testing.engines.InMemoryEngineClient` is the in-process
stand-in the HTTP tests use.)

No request waits forever: a worker that dies is noticed through its lease, and one that
holds its lease but stops answering a request is caught by the `StreamDeadlines` (first
output, then between outputs); both count as losing the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from dynamo.llm.protocols import LLMEngineOutput, PreprocessedRequest
from dynamo.llm.router import AllWorkersBusyError, Router
from dynamo.runtime import (
    Client,
    ClientClosedError,
    ConnectionLostError,
    DynamoRuntimeError,
    ErrorKind,
    InstanceGoneError,
    InstanceOverloadedError,
    NoInstancesError,
    NoResponderError,
    RemoteError,
    RequestTooLargeError,
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


class EngineUnavailableError(Exception):
    """No worker can take the request right now (HTTP 503)."""


class EngineOverloadedError(EngineUnavailableError):
    """Workers exist but none takes more work now: every one tried refused the request
    (its bound of requests in flight), or the router judged them all busy (HTTP 503 with
    `Retry-After`)."""


class EngineFailedError(Exception):
    """The worker failed the request (HTTP 500, or an error event mid-stream)."""


class EngineRejectedError(Exception):
    """The worker refused the request's parameters: the client's error (HTTP 400), with
    the engine's one-line reason."""


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


# Attempts to place a request when its worker vanishes before producing any output.
MAX_PLACEMENT_ATTEMPTS = 3


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
    ) -> None:
        self._client = client
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
                raise EngineFailedError(_lost_message(lost))
            if isinstance(lost, InstanceOverloadedError):  # instances exist, all refused
                raise EngineOverloadedError(f"every instance of {request.model} refused: {lost}")
            raise EngineUnavailableError(f"no instances serve model {request.model}")
        try:
            return await self._router.select(request, candidates)
        except AllWorkersBusyError as exc:
            if resuming:
                raise EngineFailedError(f"worker lost and every other one is busy: {exc}") from exc
            raise EngineOverloadedError(str(exc)) from exc

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


class RequestLegs:
    """Where one request stands across its legs: the tokens streamed so far, the instances
    it was lost on, and the placements and migrations used. It decides what a lost or
    refusing worker means: place the request again (nothing streamed yet), migrate it
    (tokens streamed, migrations left), or fail it."""

    def __init__(
        self,
        request: PreprocessedRequest,
        migration_limit: int,
        *,
        unreachable_patience_s: float = 0.0,
    ) -> None:
        self.request = request
        self.leg = request  # what the next placement sends
        self.migration_limit = migration_limit
        self.generated: list[int] = []  # streamed to the caller, over all legs
        self.failed: set[int] = set()  # instances this request was lost on or refused by
        self.placements = 0
        self.migrations = 0
        self.lost: DynamoRuntimeError | None = None  # why the last placement failed
        self._first_of_leg = True
        # How long "no responders" is waited out (see RuntimeEngineClient), from the first.
        self.unreachable_patience_s = unreachable_patience_s
        self._unreachable_since: float | None = None

    @property
    def resuming(self) -> bool:
        return bool(self.generated)

    def record(self, output: LLMEngineOutput, already: int) -> bool:
        """Note `output` of the current leg (restating a continuation's usage); True for
        the leg's first output."""
        first, self._first_of_leg = self._first_of_leg, False
        self.generated.extend(output.token_ids)
        if already:
            _account_for_migration(output, len(self.request.token_ids), already)
        return first

    def lost_on(self, target: int, exc: InstanceGoneError | StreamTimeoutError) -> bool:
        """The worker `target` was lost (or went silent): prepare the next leg, or raise.
        True when the next leg is a migration."""
        migrating = self._next_leg(target, exc)
        if isinstance(exc, ConnectionLostError):
            # The worker may still run the old leg until our STOP reaches it; under its
            # own id the new leg would be refused there as a duplicate.
            attempt = self.placements + self.migrations
            self.leg = msgspec.structs.replace(
                self.leg, request_id=f"{self.request.request_id}-r{attempt}"
            )
        return migrating

    def _next_leg(self, target: int, exc: InstanceGoneError | StreamTimeoutError) -> bool:
        if isinstance(exc, NoResponderError) and self._waits_out(exc):
            return False
        self._exclude(target, exc)
        request_id = self.request.request_id
        if not self.generated and self.placements + 1 < MAX_PLACEMENT_ATTEMPTS:
            self.placements += 1
            log.warning(
                "request %s: worker lost before first output (%s), placing it again",
                request_id, exc,
            )  # fmt: skip
            return False
        unresumable = unresumable_reason(self.request)
        if self.generated and unresumable is not None:
            raise EngineFailedError(f"{_lost_message(exc)}; not migrated: {unresumable}") from exc
        if self.generated and self.migrations < self.migration_limit:
            self.migrations += 1
            self.leg = continuation(self.request, self.generated)
            log.warning(
                "request %s: worker lost after %d tokens (%s); migrating (%d of %d)",
                request_id, len(self.generated), exc, self.migrations, self.migration_limit,
            )  # fmt: skip
            return True
        raise EngineFailedError(_lost_message(exc)) from exc

    def _waits_out(self, exc: NoResponderError) -> bool:
        """Whether this "no responders" is sent again as it is (same leg, no placement
        charged, the instance not excluded): until `unreachable_patience_s` has passed
        since the first one."""
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        if now - self._unreachable_since >= self.unreachable_patience_s:
            return False
        self._note_lost(exc)
        log.debug("request %s: %s; sending it again", self.request.request_id, exc)
        return True

    def refused_by(self, target: int, exc: InstanceOverloadedError) -> None:
        """`target` refused before running anything (full): safe to send elsewhere, up to
        the placement limit."""
        self._exclude(target, exc)
        if self.placements + 1 >= MAX_PLACEMENT_ATTEMPTS:
            if self.generated:
                raise EngineFailedError(_lost_message(exc)) from exc
            raise EngineOverloadedError(str(exc)) from exc
        self.placements += 1
        log.debug("request %s: %s; placing it again", self.request.request_id, exc)

    def _exclude(self, target: int, exc: DynamoRuntimeError) -> None:
        if not isinstance(exc, ConnectionLostError):  # our connection failed, not the worker
            self.failed.add(target)
        self._note_lost(exc)

    def _note_lost(self, exc: DynamoRuntimeError) -> None:
        """The placement failed with `exc`: the next output starts a new leg."""
        self.lost = exc
        self._first_of_leg = True


def unresumable_reason(request: PreprocessedRequest) -> str | None:
    """Why `request` cannot continue on another worker once tokens were streamed (None: it
    can). A continuation is one prompt extended by the tokens so far, so:

    * n > 1: the tokens streamed belong to n interleaved sequences, which one prompt
      cannot carry on;
    * structured output: the engine applies the grammar to the new leg's output only, so
      the continuation would start a second document after the first one's prefix.
    """
    if (request.sampling_options.n or 1) > 1:
        return "the request generates n > 1 sequences"
    if request.structured_output is not None:
        return "its output is constrained (structured output), which cannot resume mid-document"
    return None


def engine_error(exc: DynamoRuntimeError, *, resuming: bool) -> Exception:
    """The engine-client error a stream failure that cannot be retried becomes (its HTTP
    status follows from the type)."""
    if isinstance(exc, ClientClosedError):
        return (
            EngineFailedError(f"worker lost: {exc}")
            if resuming
            else EngineUnavailableError(str(exc))
        )
    if isinstance(exc, NoInstancesError):
        if resuming:
            return EngineFailedError(f"worker lost and no instance to continue on: {exc}")
        return EngineUnavailableError(str(exc))
    if isinstance(exc, RequestTooLargeError):
        if resuming:  # the prompt plus the tokens so far outgrew one message
            return EngineFailedError(f"worker lost and the request cannot continue: {exc}")
        return EngineRejectedError(
            f"{exc}; shorten the prompt or the request's lists (stop_token_ids, choices)"
        )
    if isinstance(exc, RemoteError):
        if exc.kind is ErrorKind.INVALID_REQUEST:
            return EngineRejectedError(exc.message)
        return EngineFailedError(exc.message)
    return EngineFailedError(f"{type(exc).__name__}: {exc}")  # protocol errors, shutdown


def _lost_message(exc: DynamoRuntimeError) -> str:
    if isinstance(exc, StreamTimeoutError):
        return f"worker stopped responding: {exc}"
    return f"worker lost during the request: {exc}"


def continuation(request: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
    """The request that resumes `request` on another worker after `generated` tokens.
    The prompt's logprobs came with the first leg's first output: not asked again (the
    continuation's prompt is longer, its logprobs would not be the client's)."""
    stop = request.stop_conditions
    done = len(generated)
    new_stop = msgspec.structs.replace(
        stop,
        max_tokens=None if stop.max_tokens is None else max(1, stop.max_tokens - done),
        min_tokens=None if stop.min_tokens is None else max(0, stop.min_tokens - done),
    )
    return msgspec.structs.replace(
        request,
        token_ids=[*request.token_ids, *generated],
        stop_conditions=new_stop,
        prefill_result=None,
        output_options=msgspec.structs.replace(request.output_options, prompt_logprobs=None),
    )


def _account_for_migration(output: LLMEngineOutput, prompt_len: int, carried: int) -> None:
    """A continuation leg reports usage against its extended prompt; restate it against
    the client's request (the carried tokens were generated, not prompted)."""
    usage = output.completion_usage
    if usage is None:
        return
    usage.prompt_tokens = prompt_len
    usage.completion_tokens += carried
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    details = usage.prompt_tokens_details
    if details is not None:
        details.cached_tokens = min(details.cached_tokens, prompt_len)
