"""Workers refusing requests, behind a real frontend over a real nats-server.

Two mocker workers, each accepting one request at a time (`--max-inflight-requests 1`)
and at most 2 log probabilities per token (`--max-logprobs 2`).

Claims:
* a request that reaches a worker already at its bound is refused there at once, without
  running, and the frontend places it on the other worker: the client sees a normal
  answer, and the full worker's engine never saw the request;
* when every worker is at its bound the client gets 503 with `Retry-After` at once;
* parameters a worker refuses (more logprobs than it allows) are the client's error:
  HTTP 400 with the worker's one-line reason, streaming or not, on both OpenAI endpoints;
* a second frontend over the same workers in kv mode with `--busy-kv-usage 0.1`: once
  each worker holds a long prompt (over 10 % of its KV cache, as the router books it), the
  router itself refuses the next request without sending it: with `--busy-queue-size 0`
  503 with `Retry-After` at once; with the busy queue, the request waits for a worker
  with room, most urgent `priority` first, or gets the 503 at its deadline, and leaves
  the queue at once when its client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dynamo.frontend.engine.routing import RouterMode, RouterSettings
from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.service import FrontendConfig
from dynamo.mocker.timing import TimingModel
from dynamo.runtime.ports import free_port
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.http import fetch_json, fetch_text, metric_values
from dynamo.testing.mocker_clusters import MockerCluster, mocker_cluster_fixture
from dynamo.testing.waiting import wait_until_async

MODEL = "mock-refusals"
MAX_LOGPROBS = 2
TIMEOUT_S = 20.0


@dataclass
class Cluster(MockerCluster):
    def running(self) -> list[int]:
        return [w.backend.engine.num_running + w.backend.engine.num_waiting for w in self.workers]


cluster = mocker_cluster_fixture(
    Cluster,
    MODEL,
    {
        "num_gpu_blocks": 1024,
        "max_model_len": 4096,
        "max_logprobs": MAX_LOGPROBS,
        # ~20 ms per token: a long request stays in flight while the test works.
        "timing": TimingModel(prefill_ms_per_token=0.001, decode_ms_per_step=20.0),
    },
    namespace_prefix="refuse",
    max_inflight_requests=1,
)


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


@contextlib.asynccontextmanager
async def long_stream(
    session: aiohttp.ClientSession, base: str, prompt: str = "Count to a thousand."
) -> AsyncIterator[None]:
    """A streaming request that keeps one worker busy until the block ends (leaving it
    closes the connection, which cancels the request on its worker)."""
    body = chat(prompt, max_tokens=2000, stream=True)
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the first event: it runs on a worker
        yield


async def refused_as_overloaded(
    session: aiohttp.ClientSession, base: str, content: str
) -> dict[str, Any]:
    """Send a short chat that no worker can take: it must be refused at once with 503 and
    a `Retry-After`. Returns the OpenAI error."""
    body = chat(content, max_tokens=2)
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 503, await resp.text()
        assert int(resp.headers["Retry-After"]) >= 1
        return (await resp.json())["error"]


async def settled(cluster: Cluster) -> None:
    """Wait until no request runs on any worker (a previous test's streams ended)."""
    await wait_until_async(
        lambda: (
            sum(cluster.running()) == 0
            and all(w.backend.engine.sequences.active_requests == 0 for w in cluster.workers)
        ),
        timeout=TIMEOUT_S,
        what="the workers to be idle",
    )


async def test_a_full_worker_refuses_and_the_request_runs_on_the_other(cluster: Cluster) -> None:
    await settled(cluster)
    async with aiohttp.ClientSession() as session, long_stream(session, cluster.base):
        busy = [i for i, n in enumerate(cluster.running()) if n]
        assert len(busy) == 1
        full, free = busy[0], 1 - busy[0]
        before = cluster.engine_requests()
        # Round-robin offers the full worker every other placement: at least two of
        # these four are refused there and placed again on the free one.
        for i in range(4):
            async with session.post(
                f"{cluster.base}/v1/chat/completions", json=chat(f"Question {i}.", max_tokens=2)
            ) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
                assert body["choices"][0]["finish_reason"] == "length"
        after = cluster.engine_requests()
        assert after[full] == before[full]  # refused without reaching its engine
        assert after[free] - before[free] == 4


async def test_when_every_worker_is_full_the_client_gets_503_with_retry_after(
    cluster: Cluster,
) -> None:
    await settled(cluster)
    async with (
        aiohttp.ClientSession() as session,
        long_stream(session, cluster.base),
        long_stream(session, cluster.base),
    ):
        assert cluster.running() == [1, 1]
        before = cluster.engine_requests()
        error = await refused_as_overloaded(session, cluster.base, "One more?")
        assert error["type"] == "service_unavailable"
        assert cluster.engine_requests() == before


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_parameters_a_worker_refuses_are_a_400_with_its_reason(
    cluster: Cluster, stream: bool, endpoint: str
) -> None:
    await settled(cluster)
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body = chat("Hi.", max_tokens=2, logprobs=True, top_logprobs=5, stream=stream)
    else:
        path = "/v1/completions"
        body = {"model": MODEL, "prompt": "Hi.", "max_tokens": 2, "logprobs": 5, "stream": stream}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{cluster.base}{path}", json=body) as resp:
            assert resp.status == 400, await resp.text()
            error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        f"Requested sample logprobs of 5, which is greater than max allowed: {MAX_LOGPROBS}"
    )


@contextlib.asynccontextmanager
async def kv_frontend(
    cluster: Cluster, tmp_path: Path, **router: Any
) -> AsyncIterator[tuple[InLoopFrontend, Callable[[], Awaitable[dict[str, Any]]]]]:
    """A second frontend over the workers, in kv mode with `--busy-kv-usage 0.1` (and the
    given router settings), once its router knows both workers' loads; yields it and a
    function that reads its router's view of the endpoint (`/debug/kv`)."""
    settings = RouterSettings(mode=RouterMode.KV, busy_kv_usage=0.1, **router)
    kv = InLoopFrontend(
        FrontendConfig(
            http=HttpSettings(host="127.0.0.1", port=free_port()),
            router=settings,
            namespace=cluster.namespace,
            nats_server=cluster.nats_url,
            tokenizer_cache=tmp_path / "tok-kv",
        )
    )
    endpoint = cluster.endpoint_key

    async def router_view() -> dict[str, Any]:
        return (await fetch_json(f"{kv.base_url}/debug/kv"))["models"][MODEL][endpoint]

    async def loads_known() -> bool:  # the reports carry each worker's total blocks
        try:
            workers = (await router_view())["workers"]
        except (KeyError, aiohttp.ClientError):
            return False
        return len(workers) == 2 and all(w["load"] for w in workers.values())

    try:
        await wait_until_async(loads_known, timeout=60, what="the kv router to see both loads")
        yield kv, router_view
    finally:
        await kv.stop()


def long_prompt(name: str) -> str:
    """~113 of the 1024 blocks of a worker (over 10 % once booked), none shared with
    another name's prompt: one such request makes its worker busy."""
    return f"{name} " + "word " * 1800


@contextlib.asynccontextmanager
async def both_workers_held(
    session: aiohttp.ClientSession, kv: InLoopFrontend
) -> AsyncIterator[None]:
    """A long prompt streaming on each worker: both busy for the kv frontend's router."""
    async with (
        long_stream(session, kv.base_url, long_prompt("first")),
        long_stream(session, kv.base_url, long_prompt("second")),
    ):
        yield


async def queued(kv: InLoopFrontend) -> float:
    text = await fetch_text(f"{kv.base_url}/metrics")
    return sum(metric_values(text, "dynamo_frontend_queued_requests", {"model": MODEL}))


async def queued_at_least(kv: InLoopFrontend, count: int) -> bool:
    return await queued(kv) >= count


async def queued_at_most(kv: InLoopFrontend, count: int) -> bool:
    return await queued(kv) <= count


async def test_a_kv_router_refuses_when_every_worker_is_busy(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Without a busy queue (`--busy-queue-size 0`), the 503 comes at once."""
    await settled(cluster)
    async with (
        kv_frontend(cluster, tmp_path, busy_queue_size=0) as (kv, router_view),
        aiohttp.ClientSession() as session,
        both_workers_held(session, kv),
    ):
        assert cluster.running() == [1, 1]
        before = cluster.engine_requests()
        await refused_as_overloaded(session, kv.base_url, "Short?")
        assert cluster.engine_requests() == before  # no worker was even asked
        view = await router_view()
        assert view["busy_refusals"] == 1
        assert all(w["busy"] for w in view["workers"].values())


async def test_the_busy_queue_holds_requests_until_a_worker_has_room_most_urgent_first(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Both workers busy: three requests of priority 5 queue, then one of priority -1.
    When one worker frees, each admitted request makes it busy again, so they run one
    after another: the urgent one first, then the others in their order of arrival."""
    await settled(cluster)
    ended: dict[str, float] = {}

    async def ask(session: aiohttp.ClientSession, name: str, priority: int) -> None:
        body = chat(long_prompt(name), max_tokens=3, priority=priority)
        async with session.post(f"{kv.base_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        ended[name] = time.monotonic()

    async with (
        kv_frontend(cluster, tmp_path) as (kv, _),
        aiohttp.ClientSession() as session,
        long_stream(session, kv.base_url, long_prompt("holds-b")),
    ):
        async with long_stream(session, kv.base_url, long_prompt("holds-a")):
            tasks = []
            for count, (name, priority) in enumerate(
                [("low-0", 5), ("low-1", 5), ("low-2", 5), ("urgent", -1)], start=1
            ):
                tasks.append(asyncio.ensure_future(ask(session, name, priority)))
                await wait_until_async(
                    functools.partial(queued_at_least, kv, count),
                    timeout=TIMEOUT_S,
                    what=f"{count} requests in the busy queue",
                )
            assert not ended
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        assert await queued(kv) == 0
    assert sorted(ended, key=ended.__getitem__) == ["urgent", "low-0", "low-1", "low-2"]


async def test_a_client_that_goes_away_leaves_the_queue_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    await settled(cluster)
    async with (
        kv_frontend(cluster, tmp_path) as (kv, _),
        aiohttp.ClientSession() as session,
        both_workers_held(session, kv),
    ):
        before = cluster.engine_requests()
        body = chat("Short?", max_tokens=2)
        waiting = asyncio.ensure_future(
            session.post(f"{kv.base_url}/v1/chat/completions", json=body)
        )
        await wait_until_async(
            functools.partial(queued_at_least, kv, 1), timeout=TIMEOUT_S, what="a queued request"
        )
        waiting.cancel()  # the client closes its connection
        await wait_until_async(
            lambda: queued_at_most(kv, 0), timeout=TIMEOUT_S, what="the queue to empty"
        )
        text = await fetch_text(f"{kv.base_url}/metrics")
        left = {"model": MODEL, "outcome": "cancelled"}
        assert metric_values(text, "dynamo_frontend_queue_wait_seconds_count", left) == [1.0]
        assert cluster.engine_requests() == before


async def test_a_request_that_waits_past_the_queue_deadline_gets_503(
    cluster: Cluster, tmp_path: Path
) -> None:
    await settled(cluster)
    async with (
        kv_frontend(cluster, tmp_path, busy_queue_timeout_s=0.5) as (kv, _),
        aiohttp.ClientSession() as session,
        both_workers_held(session, kv),
    ):
        before = cluster.engine_requests()
        started = time.monotonic()
        error = await refused_as_overloaded(session, kv.base_url, "Short?")
        waited = time.monotonic() - started
        assert "stayed busy for the 0.5 s" in error["message"], error
        assert waited >= 0.5
        assert cluster.engine_requests() == before
        text = await fetch_text(f"{kv.base_url}/metrics")
        assert metric_values(
            text, "dynamo_frontend_rejected_requests_total", {"reason": "busy_queue_timeout"}
        ) == [1.0]
