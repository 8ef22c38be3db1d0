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
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import msgspec

from dynamo.llm.protocols import LLMEngineOutput, PreprocessedRequest
from dynamo.llm.router import Router
from dynamo.runtime import (
    Client,
    DynamoRuntimeError,
    InstanceGoneError,
    NoInstancesError,
    RemoteError,
    ResponseStream,
)

log = logging.getLogger(__name__)

InstancesChanged = Callable[[], None]
"""Called with no arguments whenever an endpoint's set of ready instances changes."""


class EngineUnavailableError(Exception):
    """No worker can take the request right now (HTTP 503)."""


class EngineFailedError(Exception):
    """The worker failed the request (HTTP 500, or an error event mid-stream)."""


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

    A request whose worker disappears before the first output is re-placed on another
    instance (nothing was streamed yet, so the client cannot tell). A worker lost after
    that is survived by *migration*, up to `migration_limit` times (the workers'
    `--migration-limit`, advertised on their model card): the request continues on another
    instance with the tokens generated so far appended to the prompt, so the client sees
    one uninterrupted stream. With no migrations left a lost worker is an error. An
    instance that failed a request is not offered to the router again for that request.
    """

    def __init__(self, client: Client, router: Router, *, migration_limit: int = 0) -> None:
        self._client = client
        self._router = router
        self.migration_limit = max(0, migration_limit)
        self.migrations = 0  # performed, for metrics and tests

    @property
    def router(self) -> Router:
        return self._router

    def instance_ids(self) -> list[int]:
        return self._client.instance_ids()

    def on_instances_changed(self, listener: InstancesChanged) -> None:
        self._client.add_listener(lambda _ready: listener())

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
        generated: list[int] = []  # tokens streamed to the caller so far, over all legs
        failed: set[int] = set()  # instances this request was lost on
        leg = request
        placements = migrations = 0
        while True:
            produced_here = False
            already = len(generated)
            stream = await self._place(leg, failed, resuming=bool(generated))
            try:
                async for output in stream:
                    if not produced_here:
                        produced_here = True
                        self._router.on_first_output(leg.request_id, output)
                    generated.extend(output.token_ids)
                    if already:
                        _account_for_migration(output, len(request.token_ids), already)
                    yield output
                return
            except InstanceGoneError as exc:
                failed.add(stream.instance_id)
                if not generated and placements + 1 < MAX_PLACEMENT_ATTEMPTS:
                    placements += 1
                    log.warning(
                        "request %s: worker gone before first output (%s), placing it again",
                        request.request_id, exc,
                    )  # fmt: skip
                elif generated and migrations < self.migration_limit:
                    migrations += 1
                    self.migrations += 1
                    leg = continuation(request, generated)
                    log.warning(
                        "request %s: worker lost after %d tokens; migrating (%d of %d)",
                        request.request_id, len(generated), migrations, self.migration_limit,
                    )  # fmt: skip
                else:
                    raise EngineFailedError(f"worker lost during the request: {exc}") from exc
            except NoInstancesError as exc:
                if generated:
                    raise EngineFailedError(
                        f"worker lost and no instance to continue on: {exc}"
                    ) from exc
                raise EngineUnavailableError(str(exc)) from exc
            except RemoteError as exc:
                raise EngineFailedError(exc.message) from exc
            except DynamoRuntimeError as exc:  # timeouts, protocol errors, shutdown
                raise EngineFailedError(f"{type(exc).__name__}: {exc}") from exc
            finally:
                await stream.aclose()
                self._router.on_finished(leg.request_id)

    async def _place(
        self, request: PreprocessedRequest, failed: set[int], *, resuming: bool
    ) -> ResponseStream[LLMEngineOutput]:
        """Ask the router where `request` goes among the routable instances it was not
        lost on, and open the stream there (nothing is sent until it is iterated)."""
        candidates = [i for i in self._client.routable_ids() if i not in failed]
        if not candidates:
            if resuming:
                raise EngineFailedError(
                    f"worker lost and no other instance of {request.model} to continue on"
                )
            raise EngineUnavailableError(f"no instances serve model {request.model}")
        target = await self._router.select(request, candidates)
        return self._client.direct(
            request, target, response_type=LLMEngineOutput, request_id=request.request_id
        )

    async def close(self) -> None:
        await self._router.close()
        await self._client.close()


def continuation(request: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
    """The request that resumes `request` on another worker after `generated` tokens."""
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
