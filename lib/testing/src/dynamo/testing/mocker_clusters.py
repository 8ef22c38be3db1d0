"""Several simulated workers behind one in-loop frontend, and the pytest fixtures that
tests of the frontend's API over one mocker share.

`mockers_behind_frontend` is `mocker_stacks.mocker_behind_frontend` for tests that need
more than one worker, worker settings of their own (`max_inflight_requests`,
`publish_kv_events`) or router settings beyond the mode (`kv_events`).
`served_mocker_fixture` and `openai_client_fixture` make a module's `served` and `client`
fixtures: one mocker behind a frontend for the whole module, and an official `openai`
client of it per test; `mocker_cluster_fixture` makes a module's `cluster` of several.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
import pytest_asyncio

from dynamo.frontend.engine.routing import RouterMode, RouterSettings
from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.service import FrontendConfig
from dynamo.llm.worker import ServedWorker
from dynamo.mocker.args import WorkerSettings
from dynamo.mocker.backend import MockerBackend, mocker_worker
from dynamo.mocker.config import MockEngineConfig
from dynamo.runtime.ports import free_port
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.http import wait_for_instances_async
from dynamo.testing.mocker_stacks import mock_engine_config, mocker_behind_frontend

C = TypeVar("C", bound="MockerCluster")
T = TypeVar("T")


@dataclass
class MockerCluster:
    base: str
    workers: list[ServedWorker[MockerBackend]]
    namespace: str
    nats_url: str  # the nats-server the workers and the frontend use

    @property
    def endpoint_key(self) -> str:
        """The workers' endpoint as the frontend's `/debug/kv` names it."""
        return f"{self.namespace}/backend/generate"

    def engine_requests(self) -> list[int]:
        """Requests each worker's engine was handed (a refused one never is)."""
        return [w.backend.engine.counters.requests for w in self.workers]


@asynccontextmanager
async def mockers_behind_frontend(
    nats_url: str,
    model_path: Path,
    tokenizer_cache: Path,
    *,
    model: str,
    count: int = 2,
    engine_config: MockEngineConfig | None = None,
    router: RouterSettings | None = None,
    namespace_prefix: str = "mock",
    worker_name: str = "m{}",
    interval: float = 0.05,
    cluster_type: type[MockerCluster] = MockerCluster,
    **worker_settings: Any,
) -> AsyncIterator[MockerCluster]:
    """`count` mocker workers serving `model` (named `worker_name.format(i)`, with
    `worker_settings` beyond the namespace, the nats-server and a 10 s lease) and a
    frontend on a free port (`router`, round robin by default), in a namespace of their
    own, until the block exits; waits until the frontend lists every worker, and yields
    them as a `cluster_type` (a test's `MockerCluster` with more to ask them)."""
    namespace = namespace_prefix + uuid.uuid4().hex[:8]
    settings = WorkerSettings(
        namespace=namespace, nats_server=nats_url, **{"lease_ttl": 10.0, **worker_settings}
    )
    config = engine_config or mock_engine_config(model_path)
    workers = [
        mocker_worker(
            settings,
            config,
            model_path=model_path,
            served_model_name=model,
            name=worker_name.format(i),
        )
        for i in range(count)
    ]
    frontend = InLoopFrontend(
        FrontendConfig(
            http=HttpSettings(host="127.0.0.1", port=free_port()),
            router=router or RouterSettings(mode=RouterMode.ROUND_ROBIN),
            namespace=namespace,
            nats_server=nats_url,
            tokenizer_cache=tokenizer_cache,
        )
    )
    try:
        await asyncio.gather(*(w.start() for w in workers))
        # The frontend loads the tokenizer first (seconds; much longer on a busy host).
        await wait_for_instances_async(
            frontend.base_url, model, count, timeout=60, interval=interval
        )
        yield cluster_type(frontend.base_url, workers, namespace, nats_url)
    finally:
        await frontend.stop()
        await asyncio.gather(*(w.stop(drain_timeout=1.0) for w in workers))


def _module_fixture(
    open_stack: Callable[..., AbstractAsyncContextManager[T]],
    model: str,
    engine_overrides: Mapping[str, Any],
    **settings: Any,
) -> Callable[..., AsyncIterator[T]]:
    """A module-scoped fixture yielding what `open_stack` (`mocker_behind_frontend` or
    `mockers_behind_frontend`) opens over the session's nats-server and embedded model, with
    a tokenizer cache of its own: mockers serving `model` with `mock_engine_config`'s engine,
    `engine_overrides` overriding it, and `settings`."""

    @pytest_asyncio.fixture(scope="module")
    async def stack(
        nats_url: str, embedded_model: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> AsyncIterator[T]:
        async with open_stack(
            nats_url,
            embedded_model,
            tmp_path_factory.mktemp("tok"),
            model=model,
            engine_config=mock_engine_config(embedded_model, **engine_overrides),
            **settings,
        ) as opened:
            yield opened

    return stack


def mocker_cluster_fixture(
    cluster_type: type[C], model: str, engine: Mapping[str, Any], **cluster_settings: Any
) -> Callable[..., AsyncIterator[C]]:
    """A module-scoped fixture (assign it to `cluster`): `mockers_behind_frontend` serving
    `model` with `mock_engine_config`'s engine, `engine` overriding it, and
    `cluster_settings` (router, worker settings, ...); yields the `cluster_type`."""
    return _module_fixture(
        mockers_behind_frontend, model, engine, cluster_type=cluster_type, **cluster_settings
    )


Served = tuple[str, ServedWorker[MockerBackend]]


def served_mocker_fixture(
    model: str, *, router_mode: RouterMode = RouterMode.ROUND_ROBIN, **engine_overrides: Any
) -> Callable[..., AsyncIterator[Served]]:
    """A module-scoped fixture (assign it to `served`): one mocker serving `model`, with
    `mock_engine_config`'s engine and `engine_overrides`, behind a frontend routing by
    `router_mode`; yields the frontend's base URL and the worker."""
    return _module_fixture(mocker_behind_frontend, model, engine_overrides, router_mode=router_mode)


async def bad_request_of(reply: Awaitable[Any], *, stream: bool) -> openai.BadRequestError:
    """The 400 the official client raises for a request: awaiting `reply` (the client's
    call) and, when `stream`, reading the stream it returns (a refusal may come in it)."""
    with pytest.raises(openai.BadRequestError) as info:
        result = await reply
        if stream:
            async for _ in result:
                pass
    return info.value


async def refused_before_the_worker(
    served: Served, reply: Awaitable[Any]
) -> openai.BadRequestError:
    """The 400 the official client raises for a request the frontend itself refuses
    (awaiting `reply`, the client's call to the `served` frontend): the worker's engine is
    never handed it."""
    engine = served[1].backend.engine
    before = engine.counters.requests
    with pytest.raises(openai.BadRequestError) as info:
        await reply
    assert engine.counters.requests == before
    return info.value


def openai_client_fixture() -> Callable[..., AsyncIterator[openai.AsyncOpenAI]]:
    """A fixture (assign it to `client`): the official client of the module's `served`
    frontend, without retries."""

    @pytest_asyncio.fixture
    async def client(served: tuple[str, Any]) -> AsyncIterator[openai.AsyncOpenAI]:
        async with openai.AsyncOpenAI(
            base_url=served[0] + "/v1", api_key="unused", max_retries=0
        ) as c:
            yield c

    return client
