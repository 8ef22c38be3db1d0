"""Per-model admission control: beyond `max_inflight` requests, or `max_waiting` requests
waiting for a worker, a request gets 503 with `Retry-After` at once, before any work is
done for it, and is counted; places come back whatever way a request ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from frontend_support import MODEL, Frontend, Script
from http_support import (
    assert_openai_error,
    chat,
    completion,
    metric_value,
    running_frontend,
    send,
)

from dynamo.frontend.http.admission import AdmissionControl, AdmissionLimits, AdmissionRejected
from dynamo.testing.waiting import wait_until_async

REJECTED = "dynamo_frontend_rejected_requests_total"


async def open_streams(stack: AsyncExitStack, url: str, count: int) -> None:
    """`count` streaming requests whose responses have started (and stay open)."""
    session = await stack.enter_async_context(aiohttp.ClientSession())
    for _ in range(count):
        resp = await stack.enter_async_context(
            session.post(url + "/v1/chat/completions", json=chat(stream=True))
        )
        assert resp.status == 200
        await resp.content.readline()  # the first event: the request is on the engine


def inflight(frontend: Frontend) -> int:
    return frontend.service.admission.inflight(MODEL)


@pytest.fixture
async def small(tokenizer: Any) -> AsyncIterator[Frontend]:
    limits = AdmissionLimits(max_inflight=2, max_waiting=1)
    async with running_frontend(tokenizer, admission=limits, worker_wait_s=10.0) as frontend:
        yield frontend


async def test_requests_beyond_the_inflight_bound_get_503_with_retry_after(
    small: Frontend,
) -> None:
    small.engine.script = Script(delay=0.01, never_finish=True)
    async with AsyncExitStack() as streams:
        await open_streams(streams, small.url, 2)
        assert inflight(small) == 2
        # A prompt far over the context length: refused for load, not preprocessed (a 400).
        reply = await send(small.url, "/v1/completions", completion(prompt="word " * 2000))
        error = assert_openai_error(reply, 503)
        assert error["code"] == "overloaded" and error["type"] == "service_unavailable"
        assert reply.headers["Retry-After"] == "1"
        assert len(small.client.requests) == 2, "the refused request reached no engine"
        reply = await send(small.url, "/v1/chat/completions", chat())
        assert_openai_error(reply, 503)
    assert metric_value(small, REJECTED, model=MODEL, reason="inflight_limit") == 2
    requests_503 = metric_value(
        small,
        "dynamo_frontend_requests_total",
        model=MODEL,
        endpoint="chat_completions",
        request_type="unary",
        status="503",
    )
    assert requests_503 == 1
    # The streams' clients went away: their places come back.
    await wait_until_async(lambda: inflight(small) == 0, timeout=5, what="places to free")
    small.engine.script = Script()
    assert (await send(small.url, "/v1/chat/completions", chat())).status == 200


async def test_requests_beyond_the_waiting_bound_get_503_at_once(small: Frontend) -> None:
    small.client.set_instance_ids([])  # no worker: requests wait (up to 10 s here)
    waiting = asyncio.create_task(send(small.url, "/v1/chat/completions", chat()))
    await wait_until_async(
        lambda: small.service.admission.waiting(MODEL) == 1,
        timeout=5,
        what="one request waiting for a worker",
    )
    began = time.monotonic()
    reply = await send(small.url, "/v1/chat/completions", chat())
    assert time.monotonic() - began < 8.0, "refused at once, not after the 10 s worker wait"
    error = assert_openai_error(reply, 503)
    assert error["code"] == "overloaded" and reply.headers["Retry-After"] == "1"
    assert metric_value(small, REJECTED, model=MODEL, reason="worker_wait_limit") == 1
    small.client.set_instance_ids([1])  # the worker is back: the waiting request is served
    assert (await waiting).status == 200
    assert small.service.admission.waiting(MODEL) == 0 and inflight(small) == 0


async def test_places_come_back_however_a_request_ends(small: Frontend) -> None:
    """Bad input, a worker that does not come, a failing engine, a client that leaves:
    none of them keeps a place (with 2 places, a leak would show within 3 requests)."""
    for _ in range(3):
        reply = await send(small.url, "/v1/completions", completion(prompt="word " * 2000))
        assert_openai_error(reply, 400)
    small.engine.script = Script(fail_after=1)
    for _ in range(3):
        assert (await send(small.url, "/v1/completions", completion())).status == 500
    small.engine.script = Script(delay=0.01, never_finish=True)
    for _ in range(3):
        async with AsyncExitStack() as streams:
            await open_streams(streams, small.url, 1)
        await wait_until_async(lambda: inflight(small) == 0, timeout=5, what="a place to free")
    assert inflight(small) == 0
    small.engine.script = Script()
    assert (await send(small.url, "/v1/completions", completion())).status == 200


async def test_the_default_bounds_leave_ordinary_load_alone(frontend: Frontend) -> None:
    frontend.engine.script = Script(delay=0.005)
    replies = await asyncio.gather(
        *(send(frontend.url, "/v1/chat/completions", chat()) for _ in range(32))
    )
    assert [r.status for r in replies] == [200] * 32


def test_admission_counts_per_model_and_forgets_idle_models() -> None:
    control = AdmissionControl(AdmissionLimits(max_inflight=1, max_waiting=0))
    with control.admit("a"), control.admit("b"):
        with pytest.raises(AdmissionRejected) as refused, control.admit("a"):
            pass
        assert refused.value.reason == "inflight_limit"
        with pytest.raises(AdmissionRejected) as waiting, control.waiting_for_worker("a"):
            pass
        assert waiting.value.reason == "worker_wait_limit"
        assert (control.inflight("a"), control.inflight("b")) == (1, 1)
    assert (control.inflight("a"), control.waiting("a")) == (0, 0)
    with pytest.raises(ValueError):
        AdmissionLimits(max_inflight=0)
