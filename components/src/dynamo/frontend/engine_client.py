"""How the frontend talks to an engine: the `EngineClient` interface and its two
implementations.

`generate(request)` is an async generator of `LLMEngineOutput`s; closing it early (or
cancelling the task iterating it) cancels the request on the worker. The HTTP layer only
sees this interface and the two exceptions below, never the transport's own errors.

- `RuntimeEngineClient`: the real one, over `dynamo.runtime.Client` (NATS), with a
  `Router` choosing the instance.
- `InMemoryEngineClient`: calls a Python handler in-process; used by unit tests of the
  HTTP/preprocessing/streaming logic so they need no broker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec

from dynamo.frontend.routing import RoundRobinRouter, Router
from dynamo.llm.protocols import LLMEngineOutput, PreprocessedRequest

log = logging.getLogger(__name__)


class EngineUnavailableError(Exception):
    """No worker can take the request right now (HTTP 503)."""


class EngineFailedError(Exception):
    """The worker failed the request (HTTP 500, or an error event mid-stream)."""


class EngineClient(Protocol):
    def generate(self, request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        """Stream the engine's outputs; `aclose()` before the end cancels on the worker."""
        ...

    def instance_ids(self) -> list[int]: ...

    async def close(self) -> None: ...


# Attempts to place a request when its worker vanishes before producing any output.
MAX_PLACEMENT_ATTEMPTS = 3


class RuntimeEngineClient:
    """`EngineClient` over a `dynamo.runtime.Client` of one model endpoint.

    A request whose worker disappears before the first output is re-placed on another
    instance (nothing was streamed yet, so the client cannot tell). A worker lost after
    that is survived by *migration*, up to `migration_limit` times (the workers'
    `--migration-limit`, advertised on their model card): the request continues on another
    instance with the tokens generated so far appended to the prompt, so the client sees
    one uninterrupted stream. With no migrations left a lost worker is an error.
    """

    def __init__(
        self, client: Any, router: Router | None = None, *, migration_limit: int = 0
    ) -> None:
        from dynamo.runtime import (
            DynamoRuntimeError,
            InstanceGoneError,
            NoInstancesError,
            RemoteError,
        )

        self._client = client
        self._router: Router = router or RoundRobinRouter()
        self.migration_limit = max(0, migration_limit)
        self.migrations = 0  # performed, for metrics and tests
        self._no_instances = NoInstancesError
        self._gone = InstanceGoneError
        self._remote = RemoteError
        self._runtime_error = DynamoRuntimeError

    @property
    def router(self) -> Router:
        return self._router

    def instance_ids(self) -> list[int]:
        return self._client.instance_ids()

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        generated: list[int] = []  # tokens streamed to the caller so far, over all legs
        leg = request
        placements = migrations = 0
        while True:
            produced_here = False
            already = len(generated)
            stream = await self._open(leg)
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
            except self._gone as exc:
                if not generated and placements + 1 < MAX_PLACEMENT_ATTEMPTS:
                    placements += 1
                    log.warning(
                        "request %s: worker gone before first output, retrying", request.request_id
                    )
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
            except self._no_instances as exc:
                if generated:
                    raise EngineFailedError(
                        f"worker lost and no instance to continue on: {exc}"
                    ) from exc
                raise EngineUnavailableError(str(exc)) from exc
            except self._remote as exc:
                raise EngineFailedError(getattr(exc, "message", str(exc))) from exc
            except self._runtime_error as exc:  # timeouts, protocol errors, shutdown
                raise EngineFailedError(f"{type(exc).__name__}: {exc}") from exc
            finally:
                await stream.aclose()
                self._router.on_finished(leg.request_id)

    async def _open(self, request: PreprocessedRequest) -> Any:
        ids = self._client.instance_ids()
        if not ids:
            raise EngineUnavailableError(f"no instances serve model {request.model}")
        target = await self._router.select(request, ids)
        if target is None:
            return self._client.round_robin(
                request, response_type=LLMEngineOutput, request_id=request.request_id
            )
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


# An in-process engine: receives the request, yields outputs.
EngineHandler = Callable[[PreprocessedRequest], AsyncIterator[LLMEngineOutput]]


class InMemoryEngineClient:
    """`EngineClient` that runs `handler` in the caller's event loop.

    Records every request it received and which streams were closed before they ended,
    so tests can assert on cancellation.
    """

    def __init__(self, handler: EngineHandler, instance_ids: list[int] | None = None) -> None:
        self._handler = handler
        self._instance_ids = instance_ids if instance_ids is not None else [1]
        self.requests: list[PreprocessedRequest] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []

    def instance_ids(self) -> list[int]:
        return list(self._instance_ids)

    def set_instance_ids(self, instance_ids: list[int]) -> None:
        """Workers come and go (an empty list: none can take a request)."""
        self._instance_ids = list(instance_ids)

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        if not self._instance_ids:
            raise EngineUnavailableError(f"no instances serve model {request.model}")
        self.requests.append(request)
        stream = self._handler(request)
        finished = False
        try:
            async for output in stream:
                yield output
            finished = True
        finally:
            if finished:
                self.completed.append(request.request_id)
            else:
                self.cancelled.append(request.request_id)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def close(self) -> None:
        self.set_instance_ids([])
