"""`finish_leftovers` (the session's last fixture) cancels what tests leaked and names what
would make the event loop's close hang. Each case runs on a loop of its own: the
function cancels every task of the loop it runs on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

from dynamo.testing.leftovers import Leftovers, finish_leftovers


def on_own_loop(scenario: Callable[[], Awaitable[Leftovers]]) -> Leftovers:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(scenario())
    finally:
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_leaked_tasks_are_cancelled_and_nothing_is_stuck() -> None:
    async def scenario() -> Leftovers:
        for _ in range(3):
            asyncio.create_task(asyncio.sleep(3600))
        return await finish_leftovers(5)

    report = on_own_loop(scenario)
    assert report.cancelled == 3
    assert report.stuck == []


def test_a_task_that_ignores_cancellation_is_named_with_where_it_waits() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await release.wait()  # a cleanup that waits on something that never comes

    async def scenario() -> Leftovers:
        task = asyncio.create_task(stubborn(), name="stubborn-one")
        await asyncio.sleep(0)
        report = await finish_leftovers(0.3)
        release.set()
        await task
        return report

    report = on_own_loop(scenario)
    assert len(report.stuck) == 1
    assert "stubborn-one" in report.stuck[0] and "stubborn" in report.stuck[0]


def test_an_async_generator_whose_close_hangs_is_reported() -> None:
    release = asyncio.Event()

    async def stream() -> AsyncIterator[int]:
        try:
            yield 1
            yield 2
        finally:
            await release.wait()

    async def scenario() -> Leftovers:
        agen = stream()
        assert await anext(agen) == 1  # suspended, never finished: the loop must close it
        report = await finish_leftovers(0.3)
        release.set()
        await asyncio.sleep(0)
        return report

    report = on_own_loop(scenario)
    assert any("async generator" in line for line in report.stuck), report.stuck


def test_a_busy_executor_thread_is_named_and_an_idle_one_is_not() -> None:
    started, release = threading.Event(), threading.Event()

    def blocked() -> None:
        started.set()
        release.wait()

    async def scenario() -> Leftovers:
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(lambda: None)  # one idle thread in the pool
        busy = loop.run_in_executor(None, blocked)
        await asyncio.to_thread(started.wait, 10)  # a second thread: the first is blocked
        report = await finish_leftovers(0.3)
        release.set()
        await busy
        return report

    report = on_own_loop(scenario)
    assert len(report.stuck) == 1, report.stuck
    assert "executor thread" in report.stuck[0] and "blocked" in report.stuck[0]
