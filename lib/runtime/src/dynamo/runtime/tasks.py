"""Stopping background tasks without hanging.

`task.cancel(); await task` can hang forever: on Python 3.11 `asyncio.wait_for` (used by
nats-py to wait for a JetStream ack, for example) may swallow a cancellation that arrives
together with its result, and the task then carries on with its loop. `cancel_and_wait`
cancels, waits a bounded time, and cancels again until the task is done or the time is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[object] | None, timeout: float = 5.0) -> bool:
    """Cancel `task` and wait for it to finish, re-cancelling if a cancel got lost.

    Returns True when the task finished; False (logged) when it was still running after
    `timeout` seconds. Never raises the task's own exception or CancelledError.
    """
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not task.done():
        task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.warning("task %s did not stop within %.1fs", task.get_name(), timeout)
            return False
        await asyncio.wait({task}, timeout=min(0.5, remaining))
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
    return True
