"""Several simulated workers behind one in-loop frontend, and the pytest fixtures that
tests of the frontend's API over one mocker share.

`mockers_behind_frontend` is `mocker_stacks.mocker_behind_frontend` for tests that need
more than one worker, worker settings of their own (`max_inflight_requests`,
`publish_kv_events`) or router settings beyond the mode (`kv_events`).
`served_mocker_fixture` and `openai_client_fixture` make a module's `served` and `client`
fixtures: one mocker behind a frontend for the whole module, and an official `openai`
client of it per test.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass
class MockerCluster:
    base: str
    workers: list[ServedWorker[MockerBackend]]
    namespace: str

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
    **worker_settings: Any,
) -> AsyncIterator[MockerCluster]:
    """`count` mocker workers serving `model` (named `worker_name.format(i)`, with
    `worker_settings` beyond the namespace, the nats-server and a 10 s lease) and a
    frontend on a free port (`router`, round robin by default), in a namespace of their
    own, until the block exits; waits until the frontend lists every worker."""
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
        yield MockerCluster(frontend.base_url, workers, namespace)
    finally:
        await frontend.stop()
        await asyncio.gather(*(w.stop(drain_timeout=1.0) for w in workers))


Served = tuple[str, ServedWorker[MockerBackend]]


def served_mocker_fixture(
    model: str, *, router_mode: RouterMode = RouterMode.ROUND_ROBIN, **engine_overrides: Any
) -> Callable[..., AsyncIterator[Served]]:
    """A module-scoped fixture (assign it to `served`): one mocker serving `model`, with
    `mock_engine_config`'s engine and `engine_overrides`, behind a frontend routing by
    `router_mode`; yields the frontend's base URL and the worker."""

    @pytest_asyncio.fixture(scope="module")
    async def served(
        nats_url: str, embedded_model: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> AsyncIterator[Served]:
        async with mocker_behind_frontend(
            nats_url,
            embedded_model,
            tmp_path_factory.mktemp("tok"),
            model=model,
            engine_config=mock_engine_config(embedded_model, **engine_overrides),
            router_mode=router_mode,
        ) as stack:
            yield stack

    return served


async def bad_request_of(reply: Awaitable[Any], *, stream: bool) -> openai.BadRequestError:
    """The 400 the official client raises for a request: awaiting `reply` (the client's
    call) and, when `stream`, reading the stream it returns (a refusal may come in it)."""
    with pytest.raises(openai.BadRequestError) as info:
        result = await reply
        if stream:
            async for _ in result:
                pass
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
