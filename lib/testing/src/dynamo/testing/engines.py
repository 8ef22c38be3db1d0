"""In-process stand-ins for the frontend's engine clients.

`InMemoryEngineClient` implements the frontend's `EndpointClient` by calling a Python
handler in the caller's event loop, so the HTTP, preprocessing and streaming logic is
tested without a broker or a worker process. It records what it received and how each
stream ended, so tests can assert on cancellation.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from dynamo.frontend.engine.client import InstancesChanged
from dynamo.frontend.engine.errors import EngineUnavailableError
from dynamo.llm.protocols import LLMEngineOutput, PreprocessedRequest
from dynamo.llm.router import RoundRobinRouter, Router

EngineHandler = Callable[[PreprocessedRequest], AsyncGenerator[LLMEngineOutput, None]]
"""An in-process engine: receives the request, yields outputs."""


class InMemoryEngineClient:
    """An `EndpointClient` whose "workers" are one in-process handler."""

    def __init__(
        self,
        handler: EngineHandler,
        instance_ids: list[int] | None = None,
        router: Router | None = None,
    ) -> None:
        self._handler = handler
        self._instance_ids = instance_ids if instance_ids is not None else [1]
        self._router = router or RoundRobinRouter()
        self._listeners: list[InstancesChanged] = []
        self.requests: list[PreprocessedRequest] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []

    @property
    def router(self) -> Router:
        return self._router

    def instance_ids(self) -> list[int]:
        return list(self._instance_ids)

    def on_instances_changed(self, listener: InstancesChanged) -> None:
        self._listeners.append(listener)

    def set_instance_ids(self, instance_ids: list[int]) -> None:
        """Workers come and go (an empty list: none can take a request)."""
        self._instance_ids = list(instance_ids)
        for listener in list(self._listeners):
            listener()

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[LLMEngineOutput, None]:
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
            await stream.aclose()

    async def close(self) -> None:
        self.set_instance_ids([])
