"""`cancel_and_wait` stops tasks that swallow a cancellation, and never hangs."""

from __future__ import annotations

import asyncio

from dynamo.runtime.tasks import cancel_and_wait


async def test_a_task_that_swallows_one_cancel_is_cancelled_again() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 1:
                    continue  # what a racing wait_for can do
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, timeout=2)
    assert task.cancelled() and swallowed == 2


async def test_a_task_that_never_stops_gives_up_after_the_timeout() -> None:
    release = asyncio.Event()

    async def immortal() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(immortal())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert not await cancel_and_wait(task, timeout=0.3)
    assert loop.time() - started < 1.0
    release.set()  # let it end, so nothing outlives the test
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    assert task.done()


async def test_none_and_finished_tasks() -> None:
    assert await cancel_and_wait(None)

    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task)  # the task's own error is not raised here
